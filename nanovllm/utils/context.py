"""The metadata of the step being run, set by the ModelRunner and read by every Attention layer."""
from dataclasses import dataclass

import torch


@dataclass
class Context:
    """One packed step of B sequences and T = sum of their new tokens.

    is_decode: every sequence has exactly one new token (decode kernels, CUDA graphs).
    cu_seqlens_q: [B + 1] int32, offsets of each sequence's new tokens in the packed batch.
    max_seqlen_q: the longest run of new tokens.
    context_lens: [B] int32, keys per sequence after this step (cached + new tokens).
    slot_mapping: [T] int64, cache slot (block * block_size + offset) each new token's K/V goes to; -1 skips.
    block_tables: [B, max_blocks] int32, the physical KV blocks of each sequence in order.
    """
    is_decode: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 0
    context_lens: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(ctx: Context):
    global _CONTEXT
    _CONTEXT = ctx


def reset_context():
    set_context(Context())
