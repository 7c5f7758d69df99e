"""A mixture-of-experts layer's routing on the GPU: each token's top-k experts from the router's
logits (moe_topk: softmax, top-k, renormalisation in one kernel, where torch takes four), and the
token-expert pairs grouped by expert in tiles of BLOCK_M rows for the grouped GEMMs of
fused_moe.py (moe_align_block_size, vLLM's name for the same layout).

Pair p = t * top_k + j is token t's j-th choice. moe_align_block_size lays the pairs out expert by
expert, each expert's run padded up to a whole tile with the sentinel num_pairs, so that every
tile of BLOCK_M slots holds pairs of one expert: a GEMM program reads that expert's weights once
for up to BLOCK_M rows. Every size is bounded by the token count alone (at most
num_pairs + min(num_experts, num_pairs) * (BLOCK_M - 1) slots), so a CUDA graph captures it.

Up to a few thousand pairs (a decode step) the layout is counted, not sorted: the pairs are cut
into chunks; one kernel counts each chunk's pairs per expert, and a second places each pair at
its expert's run start plus the earlier chunks' pairs of that expert plus its rank among its
chunk's (a counting sort: a stable sort's order, no atomics). torch's sort of the same pairs
takes a radix sort, a search and two small kernels: five launches where this takes two.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_args, pdl_start


@triton.jit
def topk_ids(logits_ptr, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """A token's choice of experts from its E logits at logits_ptr: (x [BLOCK_E] its logits in
    float32, ids [BLOCK_K] int32 of the TOP_K largest in descending order (ties to the lower
    expert id), chosen [BLOCK_K] their logits; slots past TOP_K: id 0, logit -inf). Ranked by
    logit, as softmax is monotonic, so the choice waits for no sum (where two probabilities round
    equal, the larger logit comes first). Each choice is one max over keys (the logit's bits made
    to order as the logit does, above BLOCK_E - 1 - id): one reduction where a max and then the
    lowest id of that max took two."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a negative float's bits order backwards (its own inverse)
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - offs)
    keys = tl.where(offs < E, keys, -2**63)  # padding below every logit
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    chosen = tl.full([BLOCK_K], -float("inf"), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, 0)
        expert = BLOCK_E - 1 - (best & (BLOCK_E - 1)).to(tl.int32)
        ids = tl.where(slots == j, expert, ids)
        top = (best >> 32).to(tl.int32)
        chosen = tl.where(slots == j, (top ^ ((top >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True), chosen)
        keys = tl.where(offs == expert, -2**63, keys)
    return x, ids, chosen


@triton.jit
def topk_weights(x, chosen, RENORMALIZE: tl.constexpr):
    """The routing weights of topk_ids' choice (x, chosen: its logits and the chosen ones'): each
    chosen expert's softmax probability, exp(logit - max) / sum(exp(x - max)) in float32, divided
    by their sum with RENORMALIZE; [BLOCK_K], slots past TOP_K 0."""
    m = tl.max(chosen, 0)
    values = tl.exp(chosen - m) / tl.sum(tl.exp(x - m), 0)
    if RENORMALIZE:
        values = values / tl.sum(values, 0)
    return values


@triton.jit
def moe_topk_kernel(logits_ptr, stride, weights_ptr, ids_ptr, E, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (num_tokens,): a token's routing (topk_ids, topk_weights) to weights [num_tokens, TOP_K]
    float32 and ids [num_tokens, TOP_K] int32."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    x, ids, chosen = topk_ids(logits_ptr + row * stride, E, TOP_K, BLOCK_E, BLOCK_K)
    values = topk_weights(x, chosen, RENORMALIZE)
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + row * TOP_K + slots, values, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


def moe_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] (any float dtype; rows may be strided) -> (weights
    [num_tokens, top_k] float32, ids [num_tokens, top_k] int32): softmax in float32, the top_k
    largest, renormalised to sum to 1 with `renormalize` (Qwen3-MoE's norm_topk_prob, Mixtral)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        moe_topk_kernel[(num_tokens,)](router_logits, router_logits.stride(0), weights, ids, num_experts, TOP_K=top_k,
                                       RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
                                       BLOCK_K=triton.next_power_of_2(top_k), num_warps=1,
                                       **pdl_args(router_logits.device))
    return weights, ids


@triton.jit
def moe_align_kernel(order_ptr, bounds_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, E,
                     BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grid (E,): program e writes expert e's run of the layout. order [num_pairs]: the pairs
    sorted by expert; bounds [E + 1]: where each expert's pairs start in order, and bounds[E]
    where the last expert's pairs end (pairs left out come after it). Expert e's run starts after
    the earlier experts' runs, each padded to a multiple of BLOCK_M; its tiles get e in
    expert_ids; program 0 writes the total to num_padded."""
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    counts = tl.load(bounds_ptr + offs + 1, mask=offs < E, other=0) - tl.load(bounds_ptr + offs, mask=offs < E, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    run = tl.sum(tl.where(offs < e, padded, 0), 0)  # where expert e's run starts
    start = tl.load(bounds_ptr + e)
    count = tl.load(bounds_ptr + e + 1) - start
    rows = tl.arange(0, BLOCK_M)
    for i in range(0, tl.cdiv(count, BLOCK_M)):
        j = i * BLOCK_M + rows
        pairs = tl.load(order_ptr + start + j, mask=j < count, other=num_pairs)
        tl.store(sorted_ids_ptr + run + j, pairs.to(tl.int32))
        tl.store(expert_ids_ptr + run // BLOCK_M + i, e)
    if e == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))


def max_padded_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most slots moe_align_block_size can fill: each expert that has a pair pads its run by
    at most block_m - 1."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


# The counted layout's chunks: COUNTED_CELLS one-hot cells of [chunk, experts] (and of [chunks,
# experts] counts) per program, so 64 chunks of 64 pairs at 128 experts (512 tokens of top 8)
COUNTED_CELLS = 8192


def counted_chunk(num_experts: int) -> int:
    """Pairs per chunk of the counted layout, and its most chunks (a power of two)."""
    return max(1, COUNTED_CELLS // triton.next_power_of_2(num_experts))


def max_counted_pairs(num_experts: int) -> int:
    """The most pairs the counted layout takes: counted_chunk(num_experts) chunks of as many pairs."""
    return counted_chunk(num_experts) ** 2


@triton.jit
def moe_count_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (chunks,): counts[c, e] [chunks, BLOCK_E] int32 = chunk c's pairs (ids[c * CHUNK:
    (c + 1) * CHUNK]) of expert e; a pair left out (-1) counts for none."""
    c = tl.program_id(0)
    pairs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    experts = tl.arange(0, BLOCK_E)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + c * BLOCK_E + experts, tl.sum(onehot, 0))


@triton.jit
def moe_place_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs, num_chunks,
                     num_tiles, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                     BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """Grid (chunks,), after moe_count_kernel: program c writes its chunk's pairs to their slots,
    and its share of the tiles (TILES at a time, tiles c * TILES, (c + chunks) * TILES, ... below
    num_tiles): each tile's expert and its padding slots (num_pairs). Expert e's run starts after
    the earlier experts' runs padded to multiples of BLOCK_M; pair p of chunk c goes to that start
    plus the earlier chunks' pairs of e plus the chunk's pairs of e before p."""
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    chunks = tl.arange(0, MAX_CHUNKS)
    counts = tl.load(counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :], mask=chunks[:, None] < num_chunks,
                     other=0)
    total = tl.sum(counts, 0)  # [BLOCK_E] pairs per expert
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    before = tl.sum(tl.where(chunks[:, None] < c, counts, 0), 0)  # earlier chunks' pairs per expert
    pairs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    onehot = ids[:, None] == experts[None, :]  # [CHUNK, BLOCK_E]
    rank = tl.cumsum(onehot.to(tl.int32), 0)  # 1 + the chunk's pairs of the same expert before
    slot = tl.sum(tl.where(onehot, start[None, :] + before[None, :] + rank - 1, 0), 1)
    tl.store(sorted_ids_ptr + slot, pairs, mask=ids >= 0)
    rows = tl.arange(0, BLOCK_M)
    for t0 in range(c * TILES, num_tiles, num_chunks * TILES):
        tiles = t0 + tl.arange(0, TILES)
        # a tile's expert: the one whose run holds it (an expert without pairs has an empty run)
        mine = (end[None, :] > tiles[:, None] * BLOCK_M) & (start[None, :] <= tiles[:, None] * BLOCK_M)
        expert = tl.sum(tl.where(mine, experts[None, :], 0), 1)
        run_start = tl.sum(tl.where(mine, start[None, :], 0), 1)
        run_count = tl.sum(tl.where(mine, total[None, :], 0), 1)
        live = tl.sum(mine.to(tl.int32), 1) > 0  # tiles past num_padded belong to no expert
        tl.store(expert_ids_ptr + tiles, expert, mask=live)
        slots = tiles[:, None] * BLOCK_M + rows[None, :]
        pad = live[:, None] & (slots - run_start[:, None] >= run_count[:, None])
        tl.store(sorted_ids_ptr + slots, tl.full([TILES, BLOCK_M], 0, tl.int32) + num_pairs, mask=pad)
    if c == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         counted: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [num_tokens, top_k] (int32 or int64, each in [0, num_experts), or -1 for a pair
    to leave out: expert parallelism's other ranks' experts) -> (sorted_ids
    [max_padded_slots] int32: the pairs expert by expert, each expert's run padded to a multiple
    of block_m with num_pairs; expert_ids [max_padded_slots / block_m] int32: each tile's expert;
    num_padded [1] int32: the slots in use, a multiple of block_m). Slots and tiles past
    num_padded hold garbage: the GEMMs stop there. No host sync. counted: the counted layout
    (two kernels; up to max_counted_pairs(num_experts) pairs) or a stable sort then one kernel;
    None picks the counted one where it fits. Both give the same layout."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    slots = max_padded_slots(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(triton.cdiv(slots, block_m), dtype=torch.int32, device=flat.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
    block_e, chunk = triton.next_power_of_2(num_experts), counted_chunk(num_experts)
    if counted is None:
        counted = 0 < num_pairs <= max_counted_pairs(num_experts)
    if counted:
        chunks = triton.cdiv(num_pairs, chunk)
        assert 0 < chunks <= chunk, f"{num_pairs} pairs exceed the counted layout's {max_counted_pairs(num_experts)}"
        counts = torch.empty(chunks, block_e, dtype=torch.int32, device=flat.device)
        moe_count_kernel[(chunks,)](flat, counts, num_pairs, BLOCK_E=block_e, CHUNK=chunk, num_warps=4)
        moe_place_kernel[(chunks,)](flat, counts, sorted_ids, expert_ids, num_padded, num_pairs, chunks,
                                    expert_ids.numel(), BLOCK_E=block_e, CHUNK=chunk, MAX_CHUNKS=chunk,
                                    BLOCK_M=block_m, TILES=max(1, min(32, 4096 // block_m)), num_warps=4)
        return sorted_ids, expert_ids, num_padded
    # sorted as bytes where the ids fit (a pair left out, -1, becomes 255 and sorts after every
    # expert): 2 radix passes, not 8. 256 tokens of top 8 on an H200, a CUDA graph of 48: the sort
    # 20.9 us as int32, 14.4 as bytes with the conversion; the same order
    keys = flat.to(torch.uint8) if num_experts < 255 else flat
    experts, order = torch.sort(keys, stable=True)
    bounds = torch.searchsorted(experts, torch.arange(num_experts + 1, device=flat.device, dtype=experts.dtype))
    moe_align_kernel[(num_experts,)](order, bounds, sorted_ids, expert_ids, num_padded, num_pairs, num_experts,
                                     BLOCK_E=block_e, BLOCK_M=block_m, num_warps=1)
    return sorted_ids, expert_ids, num_padded
