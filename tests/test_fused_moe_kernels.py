"""The mixture-of-experts kernels (kernels/moe_routing.py, kernels/fused_moe.py) in Triton's
interpreter (on CUDA where there is one) at small awkward sizes, against float64 references:
top-k routing, the expert-sorted layout, and both GEMM paths stage by stage with their outputs
poisoned (NaN) first, so a row a kernel fails to write shows. Experts with no token, one token,
and more tokens than a tile; hidden and intermediate sizes that no tile divides; float8 weights."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from nanovllm.kernels.fp8 import quantize_fp8  # noqa: E402
from nanovllm.kernels.fused_moe import (MoEConfig, down_pairs, down_sorted, fused_experts, fused_moe,  # noqa: E402
                                        gate_up_pairs, gate_up_sorted, moe_sum)
from nanovllm.kernels.moe_routing import moe_align_block_size, moe_topk  # noqa: E402
from nanovllm.layers.moe_method import torch_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}
PAIRS = MoEConfig(pairs=True, pair_n=16, pair_k=32, down_n=8, down_k=16)
SORTED = [MoEConfig(block_m=16, block_n=32, block_k=32, group_m=1), MoEConfig(block_m=16, block_n=16, block_k=16,
                                                                             group_m=3)]


def routing(num_tokens, num_experts, top_k, seed):
    """Distinct experts per token; expert 1 never chosen, expert 0 by every token (more than a
    tile of 16 rows once num_tokens > 16), the rest at random."""
    g = torch.Generator().manual_seed(seed)
    others = [e for e in range(2, num_experts)]
    ids = torch.tensor([[0] + [others[i] for i in torch.randperm(len(others), generator=g)[:top_k - 1]]
                        for _ in range(num_tokens)], dtype=torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def problem(num_tokens, num_experts, top_k, hidden, inter, dtype, fp8=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    scales = (None, None)
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8(w13), quantize_fp8(w2)
        scales = (s13.to(DEVICE), s2.to(DEVICE))
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    return x, w13.to(DEVICE), w2.to(DEVICE), scales, *routing(num_tokens, num_experts, top_k, seed)


def reference(x, w13, w2, scales, weights, ids):
    """(h [pairs, N], out [T, H]) in float64 and the sums of the magnitudes of their terms, the
    scale of the error of any order of float sums (for the tolerance); expert by expert, so that
    it fits at any size."""
    (t, k), inter = ids.shape, w2.size(-1)
    h = torch.empty(t * k, inter, dtype=torch.float64, device=x.device)
    h_abs = torch.empty_like(h)
    terms = torch.empty(t * k, x.size(1), dtype=torch.float64, device=x.device)
    terms_abs = torch.empty_like(terms)
    flat = ids.reshape(-1).long()
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero()[:, 0]
        w_gate_up, w_down = w13[expert].double(), w2[expert].double()
        if scales[0] is not None:
            w_gate_up, w_down = w_gate_up * scales[0][expert, :, None], w_down * scales[1][expert, :, None]
        xs = x[pairs // k].double()
        gate, up = (xs @ w_gate_up.t()).chunk(2, -1)
        gate_abs, up_abs = (xs.abs() @ w_gate_up.abs().t()).chunk(2, -1)
        h[pairs] = F.silu(gate) * up
        h_abs[pairs] = (F.silu(gate).abs() + gate_abs) * up_abs  # |silu(g)| and its error's growth: |silu'| <= 1.1
        weight = weights.reshape(-1, 1)[pairs].double()
        terms[pairs] = weight * (h[pairs] @ w_down.t())
        terms_abs[pairs] = weight * (h_abs[pairs] @ w_down.abs().t())
    return h, h_abs, terms.view(t, k, -1).sum(1), terms_abs.view(t, k, -1).sum(1)


def assert_close(got, want, magnitude, dtype, accumulated):
    """Each value within (3 roundings to dtype + `accumulated` float32 additions) of the terms'
    magnitudes: the rounding of h, of each expert's output and of the sum, and the float32
    accumulation over the products' K."""
    bound = (3 * UNIT_ROUNDOFF[dtype] + accumulated * 2**-24) * magnitude + 1e-30
    err = (got.double() - want).abs()
    assert torch.isfinite(got).all() and (err <= bound).all(), (err / bound).max().item()


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def test_moe_topk_matches_torch():
    g = torch.Generator().manual_seed(0)
    for num_experts, top_k, dtype in ((6, 1, torch.float32), (7, 3, torch.float16), (128, 8, torch.float32)):
        logits = (torch.randn(9, num_experts + 5, generator=g) * 3).to(DEVICE, dtype)[:, 5:]  # strided rows
        for renormalize in (False, True):
            weights, ids = moe_topk(logits, top_k, renormalize)
            ref_w, ref_ids = torch.softmax(logits.double(), -1).topk(top_k, -1)
            if renormalize:
                ref_w = ref_w / ref_w.sum(-1, keepdim=True)
            assert ids.dtype == torch.int32 and weights.dtype == torch.float32
            assert torch.equal(ids.long(), ref_ids)
            torch.testing.assert_close(weights.double(), ref_w, rtol=1e-6, atol=1e-7)
    tied = torch.tensor([[-1.0, 3.0, -0.5, 3.0, -3.0, 3.0, -0.5]], device=DEVICE)  # ties go to the lower id
    assert moe_topk(tied, 5, False)[1].tolist() == [[1, 3, 5, 2, 6]]


@pytest.mark.parametrize("counted", [True, False])
@pytest.mark.parametrize("num_experts", [8, 300])
@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (5, 4), (37, 16), (40, 4)])
def test_moe_align_block_size_groups_pairs_by_expert(num_tokens, block_m, num_experts, counted):
    """Every pair in exactly one slot, in order within its expert, each tile's pairs of its
    expert, runs padded to whole tiles with the sentinel num_pairs, unused experts given no tile,
    pairs left out (-1) in none; counted, and sorted as bytes (8 experts) and as int32 (300)."""
    _, ids = routing(num_tokens, 8, 3, seed=num_tokens)
    ids[ids == 7] = 6
    if num_tokens == 40:  # some pairs left out (expert parallelism's other ranks' experts)
        ids[::3, 1] = -1
    kept = (ids.reshape(-1) >= 0).nonzero().squeeze(1).cpu()
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, num_experts, block_m, counted=counted)
    flat, pairs = ids.reshape(-1).cpu(), ids.numel()
    counts = torch.bincount(flat[kept].long(), minlength=num_experts)
    assert num_padded.item() == sum(-(-c // block_m) * block_m for c in counts.tolist())
    slots = sorted_ids[:num_padded.item()].cpu().view(-1, block_m)
    assert sorted(slots[slots < pairs].tolist()) == kept.tolist()
    assert slots[slots < pairs].tolist() == sorted(kept.tolist(), key=lambda p: flat[p].item())  # stable
    assert ((slots < pairs) | (slots == pairs)).all()
    tiles = expert_ids[:slots.size(0)].cpu()
    for tile, expert in zip(slots, tiles.tolist()):
        assert (flat[tile[tile < pairs].long()] == expert).all() and (tile < pairs).any()
    assert set(tiles.tolist()) == {e for e in range(num_experts) if counts[e] > 0}


@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (9, 16), (300, 32), (512, 64)])
def test_counted_layout_equals_the_sorted_one(num_tokens, block_m):
    """Qwen3-30B-A3B's routing (128 experts, top 8) up to the counted layout's most pairs (4096:
    64 chunks), a fifth of the pairs left out: the same slots, tiles and count as the sort's."""
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, 128, generator=g).topk(8, -1).indices.to(torch.int32)
    ids[torch.rand(num_tokens, 8, generator=g) < 0.2] = -1
    ids = ids.to(DEVICE)
    got = moe_align_block_size(ids, 128, block_m, counted=True)
    want = moe_align_block_size(ids, 128, block_m, counted=False)
    used = want[2].item()
    assert got[2].item() == used
    assert torch.equal(got[0][:used], want[0][:used])
    assert torch.equal(got[1][:used // block_m], want[1][:used // block_m])


# bfloat16 on CUDA only: Triton's interpreter converts float32 to bfloat16 by truncation
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * (DEVICE == "cuda"))
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 33), (5, 3, 2500), (17, 2, 64)])
def test_moe_sum_rounds_the_float32_sum_once(num_tokens, top_k, hidden, dtype):
    """Each token's top_k rows summed into a strided, poisoned output (a tensor-parallel
    partial-sums buffer's rows): the float32 sum rounded to the dtype, within one rounding; the
    columns past hidden untouched."""
    y = torch.randn(num_tokens * top_k, hidden, generator=torch.Generator().manual_seed(hidden)).to(dtype).to(DEVICE)
    buf = torch.full((num_tokens, hidden + 7), float("nan"), dtype=dtype, device=DEVICE)
    got = moe_sum(y, buf[:, :hidden])
    want = y.double().view(num_tokens, top_k, hidden).sum(1)
    torch.testing.assert_close(got.double(), want, rtol=UNIT_ROUNDOFF[dtype], atol=1e-6 * top_k)
    assert buf[:, hidden:].isnan().all()


CASES = [  # (num_tokens, num_experts, top_k, hidden, intermediate)
    (1, 4, 2, 48, 40), (3, 7, 3, 33, 20), (37, 6, 2, 64, 48)]


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.float16, False), (torch.float16, True)])
@pytest.mark.parametrize("case", CASES)
def test_both_paths_stage_by_stage(case, dtype, fp8):
    num_tokens, num_experts, top_k, hidden, inter = case
    x, w13, w2, (s13, s2), weights, ids = problem(*case, dtype, fp8)
    h_ref, h_abs, out_ref, out_abs = reference(x, w13, w2, (s13, s2), weights, ids)
    pairs = num_tokens * top_k
    configs = ([PAIRS] if num_tokens <= 3 else []) + SORTED
    for config in configs:
        h = poisoned(pairs, inter, dtype=dtype)
        out = poisoned(num_tokens, hidden + 3, dtype=dtype)[:, :hidden]  # rows strided, as a TP buffer may be
        if config.pairs:
            gate_up_pairs(x, w13, s13, ids, config, out=h)
            assert_close(h, h_ref, h_abs, dtype, hidden)
            down_pairs(h, w2, s2, ids, weights, out, config)
        else:
            align = moe_align_block_size(ids, num_experts, config.block_m)
            gate_up_sorted(x, w13, s13, ids, align, config, out=h)
            assert_close(h, h_ref, h_abs, dtype, hidden)
            y = down_sorted(h, w2, s2, weights, align, config, out=poisoned(pairs, hidden, dtype=dtype))
            torch.sum(y.view(num_tokens, top_k, hidden), 1, out=out)
        assert_close(out, out_ref, out_abs, dtype, hidden + inter + top_k)


def test_pair_kernels_read_float8_subnormals():
    """Float8 expert weights that are all e4m3 subnormals (exponent field 0, either sign), which a
    kernel that flushed them would read as 0, through both pair kernels against the reference."""
    case = (3, 7, 3, 33, 20)
    x, _, _, _, weights, ids = problem(*case, torch.float16)
    g = torch.Generator().manual_seed(1)
    (_, num_experts, _, hidden, inter) = case
    w13, w2 = (((torch.randint(1, 8, shape, generator=g) + torch.randint(0, 2, shape, generator=g) * 128)
                .to(torch.uint8).view(torch.float8_e4m3fn).to(DEVICE))
               for shape in ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter)))
    s13, s2 = (torch.rand(*shape, generator=g).to(DEVICE) * 32 + 32
               for shape in ((num_experts, 2 * inter), (num_experts, hidden)))
    h_ref, h_abs, out_ref, out_abs = reference(x, w13, w2, (s13, s2), weights, ids)
    h = poisoned(3 * 3, inter, dtype=torch.float16)
    gate_up_pairs(x, w13, s13, ids, PAIRS, out=h)
    assert_close(h, h_ref, h_abs, torch.float16, hidden)
    out = poisoned(3, hidden, dtype=torch.float16)
    down_pairs(h, w2, s2, ids, weights, out, PAIRS)
    assert_close(out, out_ref, out_abs, torch.float16, hidden + inter + 3)


@pytest.mark.parametrize("num_tokens", [2, 37])
def test_fused_experts_and_the_torch_path(num_tokens):
    """fused_experts with its default path for the size, and the engine's CPU path (torch_experts)
    with model-dtype and float8 weights, against the reference."""
    for fp8 in (False, True):
        case = (num_tokens, 6, 2, 48, 24)
        x, w13, w2, scales, weights, ids = problem(*case, torch.float32, fp8, seed=num_tokens)
        _, _, out_ref, out_abs = reference(x, w13, w2, scales, weights, ids)
        for run in (fused_experts, torch_experts):
            out = run(x, w13, w2, weights, ids, *scales)
            assert out.shape == x.shape and out.dtype == x.dtype
            assert_close(out, out_ref, out_abs, torch.float32, 48 + 24 + 2)


@pytest.mark.parametrize("case", CASES[:2])
def test_pair_kernel_routes_as_moe_topk(case):
    """fused_moe from the router's logits: on the pair path its gate/up kernel chooses the experts
    itself and writes them (ids poisoned -7, weights NaN first) exactly as moe_topk chooses them,
    taken through the expert map with expert parallelism (no weight for another rank's pairs),
    and the layer's output equals fused_experts' with moe_topk's choice, bitwise; on the sorted
    path too."""
    num_tokens, num_experts, top_k, hidden, inter = case
    x, w13, w2, scales, _, _ = problem(*case, torch.float16, seed=5)
    g = torch.Generator().manual_seed(num_tokens)
    logits = (torch.randn(num_tokens, num_experts + 3, generator=g) * 2).to(DEVICE, torch.float16)[:, 3:]
    half = torch.full((num_experts,), -1, dtype=torch.int32, device=DEVICE)
    half[:num_experts // 2] = torch.arange(num_experts // 2, dtype=torch.int32, device=DEVICE)
    for renormalize in (False, True):
        want_weights, want_ids = moe_topk(logits, top_k, renormalize)
        for expert_map in (None, half):
            local = slice(None) if expert_map is None else slice(0, num_experts // 2)
            mapped = want_ids if expert_map is None else expert_map[want_ids.long()]
            ids = torch.full_like(want_ids, -7)
            weights = torch.full_like(want_weights, float("nan"))
            h = poisoned(num_tokens * top_k, inter, dtype=torch.float16)
            gate_up_pairs(x, w13[local], None, ids, PAIRS, out=h, route=(logits, renormalize, weights, expert_map))
            live = mapped.reshape(-1) >= 0
            assert torch.equal(ids, mapped) and torch.equal(weights.view(-1)[live], want_weights.view(-1)[live])
            assert torch.equal(h[live], gate_up_pairs(x, w13[local], None, mapped, PAIRS)[live])
            for config in (PAIRS, SORTED[0]):
                out = poisoned(*x.shape, dtype=x.dtype)
                got = fused_moe(x, logits, w13[local], w2[local], top_k, renormalize, out=out, expert_map=expert_map,
                                config=config)
                assert torch.equal(got, fused_experts(x, w13[local], w2[local], want_weights, want_ids,
                                                      expert_map=expert_map, config=config))


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_ranks_skip_the_others_experts(case):
    """Expert parallelism: each of two ranks holds a block of the experts (FusedMoE's expert_map:
    -1 for the other's). Each rank's output, on both paths, is the reference with the other's
    pairs weighted 0, poisoned outputs first; the torch path's too; the ranks' sum is the whole."""
    num_tokens, num_experts, top_k, hidden, inter = case
    dtype = torch.float32
    x, w13, w2, scales, weights, ids = problem(*case, dtype, seed=3)
    _, _, whole, whole_abs = reference(x, w13, w2, scales, weights, ids)
    configs = ([PAIRS] if num_tokens <= 3 else []) + SORTED
    total = torch.zeros_like(whole)
    for first, last in ((0, num_experts // 2), (num_experts // 2, num_experts)):
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=DEVICE)
        expert_map[first:last] = torch.arange(last - first, dtype=torch.int32, device=DEVICE)
        mine = (ids >= first) & (ids < last)
        _, _, want, want_abs = reference(x, w13, w2, scales, weights * mine, ids)
        for config in configs:
            out = poisoned(num_tokens, hidden, dtype=dtype)
            fused_experts(x, w13[first:last], w2[first:last], weights, ids, out=out, expert_map=expert_map, config=config)
            assert_close(out, want, want_abs, dtype, hidden + inter + top_k)
        out = torch_experts(x, w13[first:last], w2[first:last], weights, ids, expert_map=expert_map)
        assert_close(out, want, want_abs, dtype, hidden + inter + top_k)
        total += out.double()
    assert_close(total, whole, whole_abs, dtype, hidden + inter + top_k + 1)
