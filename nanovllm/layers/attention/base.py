"""What an attention backend is: the metadata it reads each step, and the methods the model
(forward), the KV cache (bind_kv_cache) and the CUDA graph runner (the graph hooks) call.

To add a backend, subclass AttentionBackend, override `attend` (or `forward`, to fuse the
rotary embedding with the K/V store; `build_metadata` for metadata of its own), and name it in
`nanovllm.layers.attention.BACKENDS`.
"""
from dataclasses import dataclass

import torch

from nanovllm.kernels.fp8 import quantize_fp8


@dataclass
class AttentionMetadata:
    """One packed step of B sequences and T new tokens, on the device.

    positions: [T] int64, position of each new token in its sequence.
    slot_mapping: [T] int64, KV cache slot (block * block_size + offset) of each new token; -1 skips.
    cu_seqlens_q: [B + 1] int32, offsets of each sequence's new tokens in the packed batch.
    context_lens: [B] int32, keys per sequence after this step (cached + new tokens).
    block_tables: [B, max_blocks] int32, each sequence's physical KV blocks in order.
    max_seqlen_q: the longest run of new tokens. uniform_q_len: every sequence's number of new
    tokens when they are all equal (1: a decode step, is_decode; 1 + k: verifying k draft tokens
    each), else None; CUDA graphs are captured per (batch size, uniform_q_len).
    num_decodes: the first num_decodes sequences have one new token each (in a decode step, B; as
    vLLM's split of decodes from prefills; the scheduler puts decoding sequences first).
    staged: None, or (blocks [n], block_tables [B, max_blocks]) int32 where a backend stages a
    float8 cache's blocks for this step (TritonBackend: the blocks of the sequences that q tiles
    read, each once, dequantized into the staging area in that order, and the block tables with
    those sequences' rows renumbered into it).
    work: None, or a backend's work list for this step (TritonBackend: gluon_prefill.work_list's
    [n, 2] (sequence, q tile) entries).
    """
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    uniform_q_len: int | None
    num_decodes: int = 0
    staged: tuple[torch.Tensor, torch.Tensor] | None = None
    work: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: the decode kernels' step."""
        return self.uniform_q_len == 1

    def advance(self, valid: torch.Tensor, block_size: int) -> None:
        """Make a decode step's metadata the next decode step's, in place (a CUDA graph captures
        it): each sequence of valid [B] (bool; False: padding, left as it is) one position on, its
        slot looked up in its block-table row, which must name the block."""
        step = valid.to(self.positions.dtype)
        self.positions.add_(step)
        self.context_lens.add_(step.to(self.context_lens.dtype))
        blocks = self.block_tables.gather(1, (self.positions // block_size).unsqueeze(1)).squeeze(1)
        self.slot_mapping.copy_(torch.where(valid, blocks * block_size + self.positions % block_size, -1))


class AttentionBackend:
    """Paged attention over the KV cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    (K then V; engine/kv_cache.py KVCache, with float8 data its scales). Keys and values are always
    read back from the cache, so prefix-cache hits, chunked prefill and decode are one code path.
    One instance per ModelRunner, given to every Attention layer when the model is built."""
    name = "base"
    supports_cuda_graphs = False  # True when launch shapes depend only on (batch size, uniform_q_len)
    stages_float8_prefill = False  # True: a float8 cache comes with a staging area (engine/kv_cache.py)

    def __init__(self):
        self.k_caches: list[torch.Tensor] = []  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_caches: list[torch.Tensor] = []
        self.k_scales: list[torch.Tensor | None] = []  # per layer [num_blocks, block_size, num_kv_heads] or None
        self.v_scales: list[torch.Tensor | None] = []
        self.staging: torch.Tensor | None = None  # the KV cache's staging area, if any
        self.graph_meta: AttentionMetadata | None = None
        self.graph_cu_seqlens_q: dict[int, torch.Tensor] = {}  # q_len -> the graphs' cu_seqlens_q

    def bind_kv_cache(self, kv_cache):
        """Use `kv_cache` (a KVCache) from the next step on; None unbinds it."""
        self.k_caches = [] if kv_cache is None else list(kv_cache.data[0])
        self.v_caches = [] if kv_cache is None else list(kv_cache.data[1])
        no_scales = [None] * len(self.k_caches)
        self.k_scales = no_scales if kv_cache is None or kv_cache.scales is None else list(kv_cache.scales[0])
        self.v_scales = no_scales if kv_cache is None or kv_cache.scales is None else list(kv_cache.scales[1])
        self.staging = None if kv_cache is None else kv_cache.staging

    def host_arrays(self, plan, graphed: bool = False) -> dict:
        """Arrays of this backend's own, computed on the host from the step's StepPlan and uploaded
        with it (build_metadata finds them among the tensors by name), for a step that runs eagerly
        or (graphed) replays a CUDA graph: none here."""
        return {}

    def build_metadata(self, plan, tensors: dict[str, torch.Tensor]) -> AttentionMetadata:
        """The step's metadata from its StepPlan (host) and the plan's arrays on the device (by field name)."""
        return AttentionMetadata(tensors["positions"], tensors["slot_mapping"], tensors["cu_seqlens_q"],
                                 tensors["context_lens"], tensors["block_tables"], plan.max_seqlen_q,
                                 plan.uniform_q_len, plan.num_decodes)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One Attention layer's work: rotary embedding (after the per-head norms, if any) of
        q: [T, num_heads, head_dim] and k: [T, num_kv_heads, head_dim], k and v into the cache,
        then attention. Returns [T, num_heads, head_dim]."""
        q, k = layer.rotary_emb(meta.positions, q, k, layer.qk_norms)
        self.store_kv(layer.layer_idx, k, v, meta.slot_mapping)
        return self.attend(layer.layer_idx, q, meta, layer.scale)

    def store_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
        """Scatter k, v: [T, num_kv_heads, head_dim] into layer `layer_idx`'s cache at the flat slots
        slot_mapping [T]; slot -1 is skipped. A float8 cache gets quantize_fp8's values and
        scales, one per token and head: no calibration data needed, and no saturation whatever the
        model's range of K (Qwen2's k_proj bias shifts it), for 4 bytes per 128-byte vector."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        for x, cache, scales in ((k, self.k_caches[layer_idx], self.k_scales[layer_idx]),
                                 (v, self.v_caches[layer_idx], self.v_scales[layer_idx])):
            x = x[keep]
            if scales is not None:
                x, scale = quantize_fp8(x, cache.dtype)
                scales.view(-1, x.size(1))[slots] = scale
            cache.view(-1, *x.shape[1:])[slots] = x.to(cache.dtype)

    def attend(self, layer_idx: int, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of the new tokens q: [T, num_heads, head_dim] over their sequences'
        cached keys; a query at index i of a run of n new tokens sits at position context_len - n + i."""
        raise NotImplementedError

    # ---- CUDA graphs: static metadata buffers that captured graphs read ----------------------

    def init_graph_state(self, max_num_seqs: int, max_blocks_per_seq: int, q_lens: list[int], device: torch.device):
        """Allocate the static metadata of CUDA graphs of up to max_num_seqs sequences of q_len new
        tokens each, for each q_len in q_lens (the graph runner writes each step's into them:
        kernels/graph_inputs.py); cu_seqlens_q is constant per q_len."""
        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=device)
        max_tokens = max_num_seqs * max(q_lens)
        self.graph_meta = AttentionMetadata(
            positions=zeros(max_tokens, dtype=torch.int64),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            cu_seqlens_q=None, context_lens=zeros(max_num_seqs), block_tables=zeros(max_num_seqs, max_blocks_per_seq),
            max_seqlen_q=1, uniform_q_len=1, num_decodes=max_num_seqs)
        self.graph_cu_seqlens_q = {q: torch.arange(0, q * max_num_seqs + 1, q, dtype=torch.int32, device=device)
                                   for q in q_lens}

    def graph_metadata(self, batch_size: int, q_len: int = 1) -> AttentionMetadata:
        """The static metadata of a step of batch_size sequences of q_len new tokens each (what a
        graph captures): a decode step for q_len 1, else a verify step (not is_decode). The graph's
        warm-up and first replay run on these values: for q_len > 1 each sequence's context is its
        q_len tokens, as kernels/graph_inputs.py pads (a context of 0 would place the queries before
        position 0, where the prefill kernel's rotary table lookups read before the table)."""
        g, num_tokens = self.graph_meta, batch_size * q_len
        if q_len > 1:
            g.context_lens[:batch_size] = q_len
        return AttentionMetadata(g.positions[:num_tokens], g.slot_mapping[:num_tokens],
                                 self.graph_cu_seqlens_q[q_len][:batch_size + 1], g.context_lens[:batch_size],
                                 g.block_tables[:batch_size], q_len, q_len, batch_size if q_len == 1 else 0)
