"""LoRA adapters on the linear layers (Hu et al. 2021): y = x W^T + scale * (x A^T) B^T for the rows
of a step whose request runs an adapter, with many adapters in one step.

LoRALinearMethod wraps a layer's own method (unquantized, FP8, with its fused norm and gate
paths): the base product first, then the adapters' delta added into its output, for the rows
that carry one only (kernels/lora.py); a one-row product (a decode step of one sequence) takes
its adapter inside the base product's own launch instead (kernels/gemv.py's GemvLoRA). A layer's
adapters sit in a slot table on the device (lora_a, lora_b: one entry per slot,
add_lora_weights), filled by the engine's LoRAManager. What
a step's rows run is the LoRAContext that every wrapper shares: set by the ModelRunner before
each forward, and under CUDA graphs static buffers written before each replay, as the attention
backend's graph metadata.

A pre-norm block's first product (qkv_proj, gate_up_proj) and down_proj (SwiGLU's gate in front)
with adapters: from two rows on, the normed or gated input is computed once (linear_method's
norm_rows, gate_rows, the kernels the base products take anyway) and read by the base product
and the shrink alike. One row keeps them fused in gemv.py's launch. A step without adapter rows
runs the base alone, and rows without an adapter are in no tile.
"""
import numpy as np
import torch
from torch import nn

from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from nanovllm.layers.linear_method import LinearMethod, gate_rows, norm_rows, one_row

GRAPH_BLOCK_M = 16  # tile rows of decode steps (and every CUDA graph): tensor cores' narrowest
PREFILL_BLOCK_M = 64  # of steps with more rows than PREFILL_MIN_ROWS
PREFILL_MIN_ROWS = 128
# kinds of layers whose delta small CUDA graphs may leave out: adapters of attention only (PEFT's
# default targets q_proj and v_proj) then add one kernel per layer, not four
SMALL_GRAPH_KINDS = (frozenset({"qkv_proj"}), frozenset({"qkv_proj", "o_proj"}))
SMALL_GRAPH_MAX_ROWS = 8
GEMV_COPIES = 8  # copies of a one-row product's shrink (kernels/gemv.py's gemv_kernel says why)


def lora_shards(layer: LinearBase) -> list[tuple[object, int]]:
    """(weight_loader shard id, this rank's output features) of each projection packed in `layer`."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [("q", q), ("k", kv), ("v", kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        return [(i, size // layer.tp_size) for i, size in enumerate(layer.output_sizes)]
    return [(None, layer.weight.size(0))]


def add_lora_weights(layer: LinearBase, kind: str, max_loras: int, max_rank: int, dtype: torch.dtype):
    """Give `layer` its adapter slot table, zeros (no adapter): lora_a [max_loras, S * max_rank,
    in_features] (the S packed projections' A stacked) and lora_b [max_loras, out_features,
    max_rank] (B scaled by the adapter's alpha / r), this rank's shards, in `dtype`; lora_bounds:
    the projections' first output columns and out_features; lora_kind: the layer's name (qkv_proj, ...)."""
    shards = lora_shards(layer)
    layer.lora_kind = kind
    layer.lora_bounds = tuple(int(b) for b in np.cumsum([0] + [size for _, size in shards]))
    device = layer.weight.device
    layer.register_buffer("lora_a", torch.zeros(max_loras, len(shards) * max_rank, layer.weight.size(1), dtype=dtype,
                                                device=device), persistent=False)
    layer.register_buffer("lora_b", torch.zeros(max_loras, layer.lora_bounds[-1], max_rank, dtype=dtype,
                                                device=device), persistent=False)


def tile_slots(num_rows: int, max_loras: int, block_m: int = GRAPH_BLOCK_M) -> int:
    """The most tiles that num_rows rows of at most max_loras adapters split into, rounded up to a
    multiple of 4 (see lora_mapping)."""
    return _round4(-(-num_rows // block_m) + min(max_loras, num_rows))


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def lora_mapping(token_slots: np.ndarray, block_m: int,
                 num_tiles: int | None = None) -> tuple[np.ndarray, int, np.ndarray]:
    """The mapping of a step whose token i runs adapter slot token_slots[i] (-1: none): (index,
    num_tiles, groups). index: int32 [3 * num_tiles + n], the tiles (slot, start, end) of at most
    block_m rows each, padded with (-1, 0, 0) to num_tiles when given, else to a multiple of 4 (so
    that the rows, after them, start 16-byte aligned as the tiles do: Triton compiles a kernel anew
    for a pointer that is not), then the n rows with an adapter grouped by slot (in token order
    within a slot); groups: [g, 3] (slot, start, end)."""
    rows = np.flatnonzero(token_slots >= 0)
    rows = rows[np.argsort(token_slots[rows], kind="stable")]
    slots = token_slots[rows]
    starts = np.flatnonzero(np.diff(slots, prepend=-2))
    groups = np.stack([slots[starts], starts, np.append(starts[1:], len(rows))[:len(starts)]], 1)
    tiles = [(slot, s, min(s + block_m, end)) for slot, start, end in groups.tolist()
             for s in range(start, end, block_m)]
    num_tiles = _round4(len(tiles)) if num_tiles is None else num_tiles
    assert len(tiles) <= num_tiles and num_tiles % 4 == 0
    tiles += [(-1, 0, 0)] * (num_tiles - len(tiles))
    index = np.concatenate([np.array(tiles, np.int32).reshape(-1), rows.astype(np.int32)])
    return index, len(tiles), groups


class LoRAContext:
    """The step's mapping from rows to adapter slots, which every LoRALinearMethod reads: tiles
    [num_tiles, 3] int32 (slot, start, end) and rows [n] int32 on the device (kernels/lora.py
    says what they are), groups (host, [g, 3]: one (slot, start, end) per slot, the torch path's),
    block_m and kinds (the layers the step's adapters change).
    tiles is None when no row carries an adapter. use_triton: the Triton kernels (CUDA, or
    Triton's interpreter), else the torch path. all_kinds: every LoRA layer's kind."""

    def __init__(self, max_loras: int, use_triton: bool):
        self.max_loras, self.use_triton = max_loras, use_triton
        self.all_kinds: frozenset = frozenset()
        self.graph_index: torch.Tensor | None = None  # CUDA graphs' static tiles then rows
        self.graph_tiles = 0  # the tiles it holds
        # int32 [LoRA layers, GEMV_COPIES, words]: each layer's shrink in a one-row step (GemvLoRA.s),
        # zeroed before every such forward
        self.one_row_s: torch.Tensor | None = None
        self.clear()

    def clear(self):
        """No adapter rows (the next forward runs the base products alone)."""
        self.tiles = self.rows = self.groups = self._index = None
        self.kinds, self.block_m = frozenset(), GRAPH_BLOCK_M

    def set_step(self, index: torch.Tensor, num_tiles: int, block_m: int, groups: np.ndarray, kinds: frozenset):
        """The mapping of an eager step (or of a graph's, to be copied by write_graph_inputs): index
        [3 * num_tiles + n] int32 on the device, the tiles then the rows."""
        self._index = index
        self.tiles, self.rows = index[:3 * num_tiles].view(num_tiles, 3), index[3 * num_tiles:]
        self.groups, self.kinds, self.block_m = groups, kinds, block_m
        if index.numel() == 3 * num_tiles + 1:  # one adapter row: one row's products may take GemvLoRA
            self.one_row_s.zero_()

    def init_one_row(self, num_layers: int, max_rank: int, device: torch.device):
        """Allocate where num_layers LoRA layers of at most three slices of rank max_rank pass their
        one-row shrink (GemvLoRA.s; rows of whole 128-byte lines)."""
        words = -(-3 * max_rank // 32) * 32
        self.one_row_s = torch.zeros(num_layers, GEMV_COPIES, words, dtype=torch.int32, device=device)

    # ---- CUDA graphs ------------------------------------------------------------------------

    def init_graph_state(self, max_num_tokens: int, device: torch.device):
        """Allocate the static mapping of CUDA graphs of up to max_num_tokens rows."""
        self.graph_tiles = tile_slots(max_num_tokens, self.max_loras)
        self.graph_index = torch.full((3 * self.graph_tiles + max_num_tokens,), -1, dtype=torch.int32, device=device)

    def graph_variants(self, num_tokens: int) -> list[frozenset | None]:
        """The graphs to capture for a graph of num_tokens rows, by the kinds of layers they add
        deltas to: None (no adapter rows), and for few rows some kinds alone (SMALL_GRAPH_KINDS),
        then all."""
        small = [k for k in SMALL_GRAPH_KINDS if k < self.all_kinds] if num_tokens <= SMALL_GRAPH_MAX_ROWS else []
        return [None, *small, self.all_kinds]

    def use_graph(self, num_tokens: int, kinds: frozenset | None):
        """Point the mapping at the static buffers, as the graph of (num_tokens, kinds) captures it."""
        self.clear()
        if kinds is not None:
            tiles = self.graph_index[:3 * self.graph_tiles].view(-1, 3)[:tile_slots(num_tokens, self.max_loras)]
            rows = self.graph_index[3 * self.graph_tiles:3 * self.graph_tiles + num_tokens]
            self.tiles, self.rows, self.kinds = tiles, rows, kinds
            if num_tokens == 1:  # the capture's warm-up forward takes GemvLoRA (replays: set_step zeroes)
                self.one_row_s.zero_()

    def write_graph_inputs(self, num_tokens: int) -> frozenset | None:
        """Copy this step's mapping into the static buffers (the planner padded its tiles to
        graph_tiles, spare ones slot -1); returns the variant of graph_variants(num_tokens) to replay."""
        if self.tiles is None:
            return None
        assert self.tiles.size(0) == self.graph_tiles and self.block_m == GRAPH_BLOCK_M
        self.graph_index[:self._index.numel()].copy_(self._index)
        return next(k for k in self.graph_variants(num_tokens)[1:] if self.kinds <= k)


class LoRALinearMethod(LinearMethod):
    """The base method's products plus the step's adapters' deltas (context: the LoRAContext)."""
    rows_independent = False  # a row's adapter is found by its place in the step

    def __init__(self, base: LinearMethod, context: LoRAContext):
        self.base, self.context = base, context
        self.quantization = base.quantization  # the experts' method follows it (moe_method.py)

    def process_weights_after_loading(self, layer):
        self.base.process_weights_after_loading(layer)

    def apply(self, layer, x, bias, gated=False, out=None):
        if not self._changes(layer):
            return self.base.apply(layer, x, bias, gated, out)
        if self._one_launch(x):
            from nanovllm.kernels.gemv import gemv
            return gemv(x, layer.weight, getattr(layer, "weight_scale", None), bias, gated, out=out,
                        lora=self._gemv_lora(layer))
        if gated:  # once for the base product and the shrink (which would read [gate | up], twice the bytes)
            x = gate_rows(x)
        return add_lora(self.context, layer, self.base.apply(layer, x, bias, False, out), x)

    def apply_norm(self, layer, x, residual, norm):
        if not self._changes(layer):
            return self.base.apply_norm(layer, x, residual, norm)
        if self._one_launch(x):
            from nanovllm.kernels.gemv import norm_gemv
            return norm_gemv(x, residual, norm.weight, norm.eps, layer.weight, getattr(layer, "weight_scale", None),
                             layer.bias, lora=self._gemv_lora(layer))
        x, r = norm_rows(x, residual, norm)  # the normed input kept for the shrink, not recomputed in it
        return add_lora(self.context, layer, self.base.apply(layer, x, layer.bias), x), r

    def _changes(self, layer) -> bool:
        """The step has adapter rows that change this layer."""
        return self.context.tiles is not None and getattr(layer, "lora_kind", None) in self.context.kinds

    def _one_launch(self, x) -> bool:
        """One row whose base product is gemv.py's: its adapter joins that launch (eight launches
        fewer per layer than shrink and expand, which made one adapter cost 2x at one sequence)."""
        return self.base.one_row_gemv and one_row(x) and self.context.use_triton

    def _gemv_lora(self, layer):
        from nanovllm.kernels.gemv import GemvLoRA
        return GemvLoRA(layer.lora_a, layer.lora_b, self.context.tiles, layer.lora_bounds,
                        self.context.one_row_s[layer.lora_index])


def add_lora(context: LoRAContext, layer: nn.Module, y: torch.Tensor, x: torch.Tensor):
    """y[rows] += delta of the layer's adapters for the step's mapping, in place (kernels/lora.py's
    arguments): lora_shrink then lora_expand at every step size (kernels/lora.py says why two)."""
    c = context
    if not c.use_triton:
        return lora_reference(y, x, layer.lora_a, layer.lora_b, c.rows, c.groups, layer.lora_bounds)
    from nanovllm.kernels.lora import lora_expand, lora_shrink  # Triton: imported only when used
    s = lora_shrink(x, layer.lora_a, c.rows, c.tiles, c.block_m)
    return lora_expand(y, s, layer.lora_b, c.rows, c.tiles, c.block_m, layer.lora_bounds)


def lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: torch.Tensor,
                   groups: np.ndarray, bounds: tuple[int, ...]) -> torch.Tensor:
    """The kernels' sums in torch, group by group (the CPU path, and what the kernels are checked
    against): for each (slot, start, end) of groups, y[rows[start:end]] += x A_slot^T B_slot^T
    with kernels/lora.py's arguments and roundings; returns y."""
    rank = lora_b.size(2)
    for slot, start, end in groups.tolist():
        index = rows[start:end].long()
        s = (x[index].float() @ lora_a[slot].float().T).to(lora_b.dtype).float()
        delta = torch.cat([s[:, j * rank:(j + 1) * rank] @ lora_b[slot, lo:hi].float().T
                           for j, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], 1)
        y[index] = (y[index].float() + delta).to(y.dtype)
    return y
