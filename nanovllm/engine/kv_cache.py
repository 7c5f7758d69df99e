"""The paged KV cache: its shape, how many blocks fit, and its allocation.

Layout: [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim], one tensor, so
a block is the same slot range in every layer; the attention backend gets it with bind_kv_cache.
A float8 cache (kv_cache_dtype="fp8") has beside it one float32 scale per stored head vector
(layers/attention/base.py store_kv says why per token and head), and, for a backend that wants one,
a staging area: blocks of one layer's K and V in the model dtype, which the Triton backend's
prefill steps dequantize their sequences' blocks into (triton_backend.py says why). With an EAGLE-3
draft (speculative decoding) each slot also keeps the target's hidden states that the draft reads
(engine/spec_decode/eagle3.py), so that they live exactly as long as the token's KV.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanovllm.config import Config


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype  # the cache's: the model dtype, or torch.float8_e4m3fn (then with scales)
    staging_blocks: int = 0  # blocks of the staging area (float8 caches only)
    staging_dtype: torch.dtype | None = None  # the model dtype: the staging area's and the hidden states'
    hidden_width: int = 0  # per token, values of the target's hidden states kept for an EAGLE-3 draft (model dtype)

    @property
    def scaled(self) -> bool:
        return self.dtype.itemsize == 1

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging area: K and V of staging_blocks blocks of one layer (0 unless float8)."""
        if not (self.scaled and self.staging_blocks):
            return 0
        per_block = self.block_size * self.num_kv_heads * self.head_dim * self.staging_dtype.itemsize
        return 2 * self.staging_blocks * per_block

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (and their scales, and its tokens' hidden states)."""
        per_head = self.head_dim * self.dtype.itemsize + (4 if self.scaled else 0)
        hidden = self.block_size * self.hidden_width * (self.staging_dtype.itemsize if self.hidden_width else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_head + hidden

    def allocate(self, num_blocks: int, device: torch.device) -> "KVCache":
        shape = (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        scales = torch.empty(shape[:-1], dtype=torch.float32, device=device) if self.scaled else None
        staging = torch.empty((2, self.staging_blocks, *shape[3:]), dtype=self.staging_dtype, device=device) \
            if self.staging_bytes else None
        # one row more than the slots: where the tokens of slot -1 (graph padding) write theirs
        hidden = torch.empty(num_blocks * self.block_size + 1, self.hidden_width, dtype=self.staging_dtype,
                             device=device) if self.hidden_width else None
        return KVCache(torch.empty(shape, dtype=self.dtype, device=device), scales, staging, hidden)


@dataclass
class KVCache:
    """data: [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim] in the cache dtype.
    scales: None, or for float8 data [2, num_layers, num_blocks, block_size, num_kv_heads] float32:
    a stored head vector's value is data.float() * scale.
    staging: None, or [2 (K, V), staging_blocks, block_size, num_kv_heads, head_dim] in the model dtype.
    hidden: None, or [num_blocks * block_size + 1, hidden_width] in the model dtype: row s the hidden
    states of the token in slot s (DecoderModel.aux_layers'), the last row a sink for slot -1."""
    data: torch.Tensor
    scales: torch.Tensor | None
    staging: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.staging, self.hidden)
                   if t is not None)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy blocks src [n] to dst [n] (int64, on the cache's device) in every layer, K and V
        (and their tokens' hidden states)."""
        for t in (self.data, self.scales):
            if t is not None:
                t[:, :, dst] = t[:, :, src]
        if self.hidden is not None:
            blocks = self.hidden[:-1].view(self.data.size(2), self.data.size(3), -1)
            blocks[dst] = blocks[src]


def num_kv_blocks(config: Config, spec: KVCacheSpec, max_blocks_per_seq: int, profile: Callable[[], int],
                  device: torch.device, world_size: int) -> int:
    """Blocks in the pool: num_kvcache_blocks when set; on GPU what fits in gpu_memory_utilization
    of total memory after the weights, the peak activations of `profile` (a warm-up step at
    the largest batch, which returns the bytes of its own temporary KV cache) and the staging
    area; on CPU cpu_kvcache_space_gib. `device`: this rank's. Under tensor parallelism every
    rank takes the fewest any rank can hold.
    Raises ValueError when not even one max_model_len sequence fits, unless max_model_len was left
    to its default (config.max_model_len_is_default): then the caller lowers it to the pool's
    size, and only a pool without a single block is an error."""
    block_bytes = spec.block_bytes
    if config.num_kvcache_blocks is not None:
        num_blocks, budget = config.num_kvcache_blocks, "num_kvcache_blocks"
    elif device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        warmup_bytes = profile()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        peak = stats["allocated_bytes.all.peak"] - warmup_bytes  # the warm-up's own KV cache is not activation
        used_outside = (total - free) - stats["reserved_bytes.all.current"]  # CUDA context, other processes
        available = total * config.gpu_memory_utilization - used_outside - peak - spec.staging_bytes
        num_blocks, budget = int(available // block_bytes), "gpu_memory_utilization"
    else:
        limit = config.max_num_seqs * max_blocks_per_seq  # more would never be used at once
        num_blocks = min(int(config.cpu_kvcache_space_gib * 2**30) // block_bytes, limit)
        budget = "cpu_kvcache_space_gib"
    if world_size > 1:
        count = torch.tensor([num_blocks], device=device)
        dist.all_reduce(count, dist.ReduceOp.MIN)
        num_blocks = int(count.item())
    if num_blocks < (1 if config.max_model_len_is_default else max_blocks_per_seq):
        raise ValueError(
            f"the KV cache holds {max(num_blocks, 0)} blocks of {spec.block_size} tokens "
            f"({max(num_blocks, 0) * block_bytes / 2**30:.2f} GiB), but one sequence of max_model_len="
            f"{config.max_model_len} needs {max_blocks_per_seq} ({max_blocks_per_seq * block_bytes / 2**30:.2f} GiB); "
            f"raise {budget} or lower max_model_len" + ("" if budget == "num_kvcache_blocks" else " (or set num_kvcache_blocks)"))
    return num_blocks
