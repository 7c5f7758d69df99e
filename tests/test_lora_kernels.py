"""LoRA's products for a batch of mixed adapters (kernels/lora.py, layers/lora.py): the torch path
against a float64 loop over rows, and the Triton kernels (shrink then expand) against the
torch path at awkward sizes (the one-row product, whose kernel norms or gates its input too, in
each mode): K not a multiple of the K step, a rank below the slot's, one to three
packed slices of unequal widths, rows of every adapter interleaved with rows of none (poisoned
with NaN: they must come out untouched), partial and spare tiles, K split over programs. Without
CUDA the kernels run in Triton's interpreter in float32 and float16 (it multiplies bfloat16 as
integers); on CUDA also in bfloat16 at Qwen3-0.6B's shapes."""
import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.kernels.activation import swiglu  # noqa: E402
from nanovllm.kernels.fp8 import quantize_fp8  # noqa: E402
from nanovllm.kernels.gemv import GemvLoRA, gemv, norm_gemv  # noqa: E402
from nanovllm.kernels.lora import MAX_SPLIT_K, SPLIT_K_PROGRAMS, lora_expand, lora_shrink, split_k_for  # noqa: E402
from nanovllm.kernels.rms_norm import rms_norm  # noqa: E402
from nanovllm.layers.lora import lora_mapping, lora_reference, tile_slots  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
MODES = ["plain", "gated", "norm"]


def problem(num_rows, k, bounds, max_loras, rank, mode, dtype, seed, block_m=16, pad=True):
    """Random operands of one LoRA layer and a step's mapping: slot tables whose adapters have
    ranks below `rank` (zero rows of A and columns of B past them), about a quarter of the rows
    without an adapter."""
    g = torch.Generator().manual_seed(seed)
    slices, n = len(bounds) - 1, bounds[-1]
    x = torch.randn(num_rows, 2 * k if mode == "gated" else k, generator=g) * 2
    a = torch.randn(max_loras, slices * rank, k, generator=g) / k ** 0.5
    b = torch.randn(max_loras, n, rank, generator=g) / rank ** 0.5
    for slot in range(max_loras):  # adapter `slot` has rank rank - slot - 1
        used = rank - slot - 1
        a.view(max_loras, slices, rank, k)[slot, :, used:] = 0
        b[slot, :, used:] = 0
    token_slots = torch.randint(-1, max_loras, (num_rows,), generator=g).numpy()
    token_slots[torch.rand(num_rows, generator=g).numpy() < 0.1] = -1
    index, num_tiles, groups = lora_mapping(token_slots, block_m, tile_slots(num_rows, max_loras, block_m)
                                            if pad else None)
    index = torch.from_numpy(index).to(DEVICE)
    y = torch.randn(num_rows, n, generator=g) * 3
    y[token_slots < 0] = float("nan")  # rows without an adapter: must stay untouched
    norm = ((torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE), 1e-6) if mode == "norm" else None
    kwargs = {"gated": mode == "gated", "norm": norm}
    ops = [t.to(dtype).to(DEVICE) for t in (x, a, b, y)]
    return ops, index[:3 * num_tiles].view(num_tiles, 3), index[3 * num_tiles:], groups, kwargs, token_slots


def layer_input(x, kwargs):
    """What the product multiplies, as gemv.py's one-row product norms or gates x in its own launch
    (rounded as the torch layers round it): silu(gate) * up of x = [gate | up], RMSNorm(x) * weight,
    or x."""
    if kwargs["gated"]:
        return swiglu(x)
    if kwargs["norm"] is not None:
        return rms_norm(x, None, *kwargs["norm"])[0]
    return x


def assert_close(actual, expected, dtype, length):
    """Equal where expected is NaN (rows without an adapter), else within two units of the last place
    of dtype (the output's rounding, and an input the kernel normed or gated rounded the other
    way) plus float32 sums of `length` terms in another order, at the output's magnitude."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    scale = expected[~nan].abs().max().item()
    atol = scale * (2 * torch.finfo(dtype).eps + length * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(actual[~nan].float(), expected[~nan].float(), rtol=0, atol=atol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bounds", [(0, 48), (0, 56, 112), (0, 40, 64, 88)])
def test_reference_matches_a_float64_loop(mode, bounds):
    (x, a, b, y), tiles, rows, groups, kwargs, token_slots = problem(29, 72, bounds, 3, 12, mode, torch.float32, 1)
    x, a, b, y = (t.cpu() for t in (x, a, b, y))
    expected = y.double().clone()
    rank = b.size(2)
    for row, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        v = x[row].double()
        if kwargs["gated"]:
            gate, up = v.chunk(2)
            v = gate * torch.sigmoid(gate) * up
        if kwargs["norm"] is not None:
            weight, eps = kwargs["norm"]
            v = v / torch.sqrt(v.pow(2).mean() + eps) * weight.cpu().double()
        s = a[slot].double() @ v
        for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            expected[row, lo:hi] += b[slot, lo:hi].double() @ s[j * rank:(j + 1) * rank]
    if kwargs["norm"] is not None:  # the torch path on the host, its operands with it
        kwargs["norm"] = (kwargs["norm"][0].cpu(), kwargs["norm"][1])
    actual = lora_reference(y.clone(), layer_input(x, kwargs), a, b, rows.cpu(), groups, bounds)
    assert_close(actual, expected.float(), torch.float32, 72 + 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else []))
@pytest.mark.parametrize("bounds", [(0, 48), (0, 56, 112), (0, 40, 64, 200)])
def test_kernels_match_the_reference(bounds, dtype):
    """37 rows of 3 adapters (tiles of 16 rows, spare tiles slot -1), K = 200: four K steps in float32."""
    (x, a, b, y), tiles, rows, groups, _, _ = problem(37, 200, bounds, 3, 12, "plain", dtype, 2)
    expected = lora_reference(y.clone(), x, a, b, rows, groups, bounds)
    s = lora_shrink(x, a, rows, tiles, 16)
    assert s.size(0) > 1  # K split over programs: the expand sums the partials
    actual = lora_expand(y.clone(), s, b, rows, tiles, 16, bounds)
    assert_close(actual, expected, dtype, 200 + 12)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bounds", [(0, 48), (0, 56, 112), (0, 40, 64, 90)])
def test_one_row_product_with_its_adapter_in_one_launch(bounds, mode, fp8):
    """gemv.py's one-row product with the row's adapter in its own launch (GemvLoRA) against the
    base product then the torch path, for every slot and for none (slot -1: the base alone), with
    partial tiles in N, K and the shrink's rows."""
    g = torch.Generator().manual_seed(30 + fp8)
    k = 200 if mode != "norm" else 130
    dtype = torch.float16
    (_, a, b, _), _, _, _, kwargs, _ = problem(1, k, bounds, 3, 12, mode, dtype, 5)
    n = bounds[-1]
    w = torch.randn(n, k, generator=g) * 0.05
    w, scale = quantize_fp8(w) if fp8 else (w.to(dtype), None)
    w, scale = w.to(DEVICE), None if scale is None else scale.to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    words = torch.zeros(4, 40, dtype=torch.int32, device=DEVICE)  # four copies of s
    config = (4, 64, 4, 2)
    for slot in (-1, 0, 1, 2):
        x = (torch.randn(1, 2 * k if mode == "gated" else k, generator=g) * 2).to(dtype).to(DEVICE)
        res = (torch.randn(1, k, generator=g) * 2).to(dtype).to(DEVICE)
        tiles = torch.tensor([[slot, 0, 1], [-1, 0, 0]], dtype=torch.int32, device=DEVICE)
        lora = GemvLoRA(a, b, tiles, bounds, words)
        words.zero_()
        if mode == "norm":
            norm_w, eps = kwargs["norm"]
            actual, r = norm_gemv(x, res, norm_w, eps, w, scale, bias, config=config, lora=lora)
            base, r_base = norm_gemv(x, res, norm_w, eps, w, scale, bias, config=config)
            assert torch.equal(r, r_base)
            x_in = r
        else:
            actual = gemv(x, w, scale, bias, gated=mode == "gated", config=config, lora=lora)
            base = gemv(x, w, scale, bias, gated=mode == "gated", config=config)
            x_in = x
        sr = (len(bounds) - 1) * 12
        assert ((words[:, :sr] >> 16) == (slot >= 0)).all() and not words[:, sr:].any()  # s flagged in each copy
        if slot < 0:
            assert torch.equal(actual, base)
            continue
        groups = np.array([[slot, 0, 1]])
        expected = lora_reference(base.clone(), layer_input(x_in, kwargs), a, b,
                                  torch.zeros(1, dtype=torch.int32, device=DEVICE), groups, bounds)
        assert not torch.equal(expected, base)
        assert_close(actual, expected, dtype, k + 12)


@pytest.mark.parametrize("block_m", [16, 64])
def test_prefill_sized_tiles(block_m):
    """A prefill-sized step (tiles of 64 rows, exact tile list, one split) and a wide K (four K steps)."""
    (x, a, b, y), tiles, rows, groups, _, _ = problem(150, 230, (0, 72, 144), 2, 16, "plain", torch.float32, 3,
                                                      block_m=block_m, pad=False)
    expected = lora_reference(y.clone(), x, a, b, rows, groups, (0, 72, 144))
    s = lora_shrink(x, a, rows, tiles, block_m)
    assert_close(lora_expand(y.clone(), s, b, rows, tiles, block_m, (0, 72, 144)), expected, torch.float32, 230 + 16)


def test_every_split_of_k_has_work():
    """The shrink's K split (as the kernel cuts it: whole BLOCK_K steps) covers K, leaves no program
    without a step, and runs at most ~SPLIT_K_PROGRAMS programs."""
    for k in (72, 200, 1024, 2048, 3072, 5120):
        for block_k in (64, 128):
            for num_tiles in range(0, 136, 4):
                split = split_k_for(k, block_k, num_tiles)
                k_len = -(-(-(-k // split)) // block_k) * block_k
                assert (split - 1) * k_len < k <= split * k_len, (k, block_k, num_tiles, split)
                assert 1 <= split <= MAX_SPLIT_K and (split == 1 or split * num_tiles <= SPLIT_K_PROGRAMS)
    assert split_k_for(1024, 128, 24) == 4  # 5 asked of 8 steps: 4 of 2, no fifth program without any


def test_mapping_covers_every_adapter_row_once():
    token_slots = np.array([2, -1, 0, 2, 2, 1, -1, 0, 2, 2, 2, 1])
    index, num_tiles, groups = lora_mapping(token_slots, 2, tile_slots(12, 3, 2))
    tiles, rows = index[:3 * num_tiles].reshape(-1, 3), index[3 * num_tiles:]
    assert rows.tolist() == [2, 7, 5, 11, 0, 3, 4, 8, 9, 10]  # grouped by slot, in token order within one
    assert groups.tolist() == [[0, 0, 2], [1, 2, 4], [2, 4, 10]]
    live = tiles[tiles[:, 0] >= 0]
    assert live.tolist() == [[0, 0, 2], [1, 2, 4], [2, 4, 6], [2, 6, 8], [2, 8, 10]]
    assert (tiles[len(live):] == [-1, 0, 0]).all() and num_tiles == tile_slots(12, 3, 2) >= len(live)
    assert lora_mapping(np.full(5, -1), 16)[1] == 0


@pytest.mark.skipif(not CUDA, reason="bfloat16 at Qwen3-0.6B's shapes on the GPU")
@pytest.mark.parametrize("num_rows", [1, 8, 256, 4096])
def test_kernels_at_model_shapes_on_cuda(num_rows):
    """qkv_proj, gate_up_proj and down_proj of Qwen3-0.6B, rank 16, 8 adapters."""
    for k, bounds in ((1024, (0, 2048, 3072, 4096)), (1024, (0, 3072, 6144)), (3072, (0, 1024))):
        block_m = 64 if num_rows > 256 else 16
        (x, a, b, y), tiles, rows, groups, _, _ = problem(num_rows, k, bounds, 8, 16, "plain", torch.bfloat16, 4,
                                                          block_m=block_m, pad=num_rows <= 256)
        expected = lora_reference(y.clone(), x, a, b, rows, groups, bounds)
        actual = lora_expand(y.clone(), lora_shrink(x, a, rows, tiles, block_m), b, rows, tiles, block_m, bounds)
        assert_close(actual, expected, torch.bfloat16, k + 16)


@pytest.mark.skipif(not CUDA, reason="bfloat16 at Qwen3-0.6B's shapes in a CUDA graph on the GPU")
def test_one_row_products_with_adapters_in_a_cuda_graph():
    """Qwen3-0.6B's four one-row products with rank-16 adapters in 8 slots (bf16, default tilings),
    28 layers' worth launched back to back in a CUDA graph (each launch may start under the one
    before), replayed with other slots: each against the base product then the torch path."""
    shapes = ((1024, (0, 2048, 3072, 4096), "norm"), (2048, (0, 1024), "plain"),
              (1024, (0, 3072, 6144), "norm"), (3072, (0, 1024), "gated"))
    g = torch.Generator().manual_seed(6)
    words = torch.zeros(28, 8, 64, dtype=torch.int32, device="cuda")
    tiles = torch.tensor([[0, 0, 1]] + [[-1, 0, 0]] * 3, dtype=torch.int32, device="cuda")
    layers = []
    for i in range(28):
        k, bounds, mode = shapes[i % 4]
        (x, a, b, _), _, _, _, kwargs, _ = problem(1, k, bounds, 8, 16, mode, torch.bfloat16, 100 + i)
        w = (torch.randn(bounds[-1], k, generator=g) * 0.03).bfloat16().cuda()
        res = torch.randn_like(x) if mode == "norm" else None
        layers.append((x, res, w, a, b, bounds, kwargs))

    def products(lora: bool):
        out = []
        for i, (x, res, w, a, b, bounds, kwargs) in enumerate(layers):
            adapter = GemvLoRA(a, b, tiles, bounds, words[i]) if lora else None
            if kwargs["norm"] is not None:
                out.append(norm_gemv(x, res, *kwargs["norm"], w, lora=adapter)[0])
            else:
                out.append(gemv(x, w, gated=kwargs["gated"], lora=adapter))
        return out

    products(True)  # compile outside the capture
    words.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = products(True)
    for slot in (3, 0, 7):
        tiles[0, 0] = slot
        for y in outputs:
            y.fill_(float("nan"))
        words.zero_()  # as the engine does before each one-row step
        graph.replay()
        torch.cuda.synchronize()
        for y, base, (x, res, w, a, b, bounds, kwargs) in zip(outputs, products(False), layers):
            x_in = x if res is None else (x + res)
            expected = lora_reference(base.clone(), layer_input(x_in, kwargs), a, b,
                                      torch.zeros(1, dtype=torch.int32, device="cuda"), np.array([[slot, 0, 1]]),
                                      bounds)
            assert_close(y, expected, torch.bfloat16, x.size(1) + 16)
