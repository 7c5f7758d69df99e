"""The one-row product kernel (kernels/gemv.py) against float64 products on awkward sizes: partial
tiles in N and K, 16-bit and float8 weights, bias, and SwiGLU's silu(gate) * up or the RMSNorm
(with the residual add) fused into the loads. Without CUDA it runs in Triton's interpreter, in
float16 (the interpreter multiplies bfloat16 as integers); on CUDA also in bfloat16 at
Qwen3-0.6B's and -8B's shapes through the linear methods (linear_method.py) and
linear.norm_linear, as the decode step of one sequence runs them."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from nanovllm.kernels.activation import silu_and_mul  # noqa: E402
from nanovllm.kernels.fp8 import quantize_fp8  # noqa: E402
from nanovllm.kernels import skinny_gemm  # noqa: E402
from nanovllm.kernels.gemv import gemv, norm_gemv  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.linear import ColumnParallelLinear, norm_linear, norm_linear_input  # noqa: E402
from nanovllm.layers.linear_method import Fp8LinearMethod, UnquantizedLinearMethod, few_rows  # noqa: E402
from nanovllm.kernels.skinny_gemm import rms_norm_rows, silu_and_mul_rows, skinny_linear  # noqa: E402
from nanovllm.distributed.state import TensorParallel  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def linear(x, w, scale, bias, gated):
    """The product as a linear layer with weight w (float8 with scale, or x's dtype) computes it."""
    method = UnquantizedLinearMethod() if scale is None else Fp8LinearMethod()
    return method.apply(SimpleNamespace(weight=w, weight_scale=scale), x, bias, gated)


def reference(x, w, scale, bias, gated):
    """float64 result of the same operands: the gate rounded to x's dtype as silu_and_mul rounds it."""
    a = silu_and_mul(x.float()).to(x.dtype) if gated else x
    w = w.double() * (1 if scale is None else scale.double()[:, None])
    return a.double() @ w.t() + (0 if bias is None else bias.double())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_awkward_sizes(fp8, gated, bias):
    g = torch.Generator().manual_seed(fp8 * 4 + gated * 2 + bias)
    for n, k, config in ((37, 100, (4, 64, 4, 2)), (5, 300, (2, 128, 4, 3)), (64, 64, (16, 32, 4, 2))):
        x = (torch.randn(1, (2 if gated else 1) * k, generator=g) * torch.rand(1, generator=g) * 4).half().to(DEVICE)
        w = torch.randn(n, k, generator=g) * 0.05
        w, scale = quantize_fp8(w) if fp8 else (w.half(), None)
        b = torch.randn(n, generator=g).half() if bias else None
        args = [t if t is None else t.to(DEVICE) for t in (w, scale, b)]
        y = gemv(x, *args, gated=gated, config=config)
        ref = reference(x.cpu(), w, scale, b, gated).to(DEVICE)
        assert y.shape == (1, n) and y.dtype == torch.float16
        assert torch.allclose(y.double(), ref, rtol=2**-10, atol=2**-10 * ref.abs().max().item()), (n, k)


def float8_bytes(n, k, g, subnormal=False):
    """Float8 e4m3 weights [n, k] of random finite bytes of either sign: every exponent, or with
    subnormal only exponent field 0 (magnitudes 2^-9 .. 7 * 2^-9), which a kernel that flushed
    subnormals would read as 0."""
    magnitude = torch.randint(1, 8, (n, k), generator=g) if subnormal else torch.randint(0, 127, (n, k), generator=g)
    sign = torch.randint(0, 2, (n, k), generator=g) * 128
    return (magnitude + sign).to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("subnormal", [False, True])
def test_gemv_every_float8_value(subnormal):
    """Float8 weights of every finite e4m3 value (or its subnormals alone) give the float64 product
    to float32 summation's error."""
    g = torch.Generator().manual_seed(int(subnormal))
    for n, k, config in ((37, 100, (4, 64, 4, 2)), (16, 1030, (8, 512, 8, 1))):
        w, scale = float8_bytes(n, k, g, subnormal), torch.rand(n, generator=g) * 2**-4 + 2**-6
        x = (torch.randn(1, k, generator=g) * 4).half()
        y = torch.full((1, n), float("nan"), dtype=torch.float16, device=DEVICE)
        gemv(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), config=config, out=y)
        ref = reference(x, w, scale, None, False)
        magnitude = x.abs().double() @ (w.double().abs() * scale.double()[:, None]).t()
        assert torch.all((y.cpu().double() - ref).abs() <= 2**-11 * ref.abs() + k * 2**-24 * magnitude), (n, k)


def normed(x, residual, norm_weight, eps):
    """layernorm.RMSNorm's result and residual sum (its torch code, run on the CPU)."""
    norm = RMSNorm(x.size(-1), eps).to(x.dtype)
    norm.weight.data.copy_(norm_weight.cpu())
    x, residual = x.cpu(), None if residual is None else residual.cpu()
    return (norm(x), x) if residual is None else norm(x, residual)


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_norm_gemv_awkward_sizes(has_residual, fp8):
    """RMSNorm(x + residual) fused into the loads, one pass of K (k <= BLOCK_K) or several; the
    residual sum is returned bit for bit as the model's add rounds it, and the normed input written
    (normed_out, poisoned first) as RMSNorm rounds it: bit for bit in the interpreter, to two
    roundings on a GPU, whose rsqrt differs from the CPU's (normed one rounding apart, then
    rounded again times the norm weight)."""
    g = torch.Generator().manual_seed(10 + has_residual * 2 + fp8)
    for n, k, config in ((37, 100, (4, 64, 4, 2)), (5, 300, (2, 512, 4, 3)), (19, 1000, (8, 256, 4, 2))):
        x, res = (torch.randn(1, k, generator=g) * 3).half(), (torch.randn(1, k, generator=g) * 3).half()
        res = res if has_residual else None
        norm_w = (1 + torch.randn(k, generator=g) * 0.2).half()
        w = torch.randn(n, k, generator=g) * 0.05
        w, scale = quantize_fp8(w) if fp8 else (w.half(), None)
        b = torch.randn(n, generator=g).half()
        dev = [t if t is None else t.to(DEVICE) for t in (x, res, norm_w, w, scale, b)]
        normed_out = torch.full_like(dev[0], float("nan"))
        y, r = norm_gemv(dev[0], dev[1], dev[2], 1e-6, *dev[3:], config=config, normed_out=normed_out)
        a, r_ref = normed(x, res, norm_w, 1e-6)
        ref = reference(a, w, scale, b, False)
        assert torch.equal(r.cpu(), r_ref)
        if CUDA:
            torch.testing.assert_close(normed_out.cpu(), a, rtol=2**-9, atol=2**-24)
        else:  # the interpreter's rsqrt is the CPU's
            assert torch.equal(normed_out, a)
        assert y.shape == (1, n) and y.dtype == torch.float16
        assert torch.allclose(y.cpu().double(), ref, rtol=2**-10, atol=2**-10 * ref.abs().max().item()), (n, k)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("k,n", [(1024, 4096), (4096, 6144)])
def test_norm_linear_one_row_on_the_gpu(k, n):
    """norm_linear at one row of bf16 (one fused kernel) against RMSNorm then the product (the
    path of more rows), to bf16's rounding of the output (2^-8)."""
    g = torch.Generator("cuda").manual_seed(k)
    x, res = (torch.randn(2, 1, k, device="cuda", generator=g) * 3).bfloat16()
    check_norm_linear(x, res, (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16(), g)


def check_norm_linear(x, res, weight, g):
    """norm_linear(x, residual) with residual None and res, and a random norm weight and bias,
    against RMSNorm then the float64 product to bf16's rounding of the output (2^-8); the residual
    sum exactly as RMSNorm returns it; norm_linear_input's product and residual sum the same, bit
    for bit, and its normed input RMSNorm's to two roundings (its rsqrt is the GEMV's, not the
    compiled norm's: a value normed one rounding apart, then rounded again times the norm weight)."""
    n, k = weight.shape
    norm = RMSNorm(k).cuda().bfloat16()
    norm.weight.data.normal_(1, 0.2, generator=g)
    layer = ColumnParallelLinear(k, n, TensorParallel(), bias=True).cuda().bfloat16()
    layer.weight.data.copy_(weight)
    layer.bias.data.normal_(0, 1, generator=g)
    for residual in (None, res):
        y, r = norm_linear(x, residual, norm, layer)
        a, r_ref = (norm(x), x) if residual is None else norm(x, residual)
        ref = a.double() @ layer.weight.double().t() + layer.bias.double()
        assert torch.equal(r, r_ref)
        assert torch.allclose(y.double(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())
        y_in, r_in, a_in = norm_linear_input(x, residual, norm, layer)
        assert torch.equal(r_in, r)
        assert torch.equal(y_in, y)  # the same kernel, with the normed input stored as well
        torch.testing.assert_close(a_in, a, rtol=2**-6, atol=2**-24)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("k,n", [(1024, 4096), (3072, 1024), (4096, 6144), (12288, 4096)])
@pytest.mark.parametrize("fp8", [False, True])
def test_linear_one_row_on_the_gpu(k, n, fp8):
    """A linear method at one row of bf16 takes the GEMV with its default tiling (gated for down_proj's
    K), equal to the float64 product to bf16's rounding of the output (2^-8)."""
    g = torch.Generator("cuda").manual_seed(k + n)
    gated = k in (3072, 12288)
    x = torch.randn(1, (2 if gated else 1) * k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w, scale = quantize_fp8(w) if fp8 else (w.bfloat16(), None)
    y = linear(x, w, scale, None, gated)
    ref = reference(x, w, scale, None, gated)
    assert torch.allclose(y.double(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_awkward_sizes(bias):
    """skinny_gemm's tensor-core product of 2-48 rows: partial tiles in M, N and K, K split in 1-4
    slices (one slice empty at k=200, split 3 of 128-wide steps, and at k=600, split 4), 64-row tiles
    in 4 stages (the default for large K at up to 16 rows), the default tiling of 33-64 rows, the
    split's counters back at zero."""
    g = torch.Generator().manual_seed(20 + bias)
    for m, n, k, config in ((2, 37, 100, (16, 64, 4, 2, 1)), (5, 40, 300, (32, 64, 4, 2, 3)),
                            (33, 16, 200, (16, 128, 4, 2, 3)), (16, 70, 1000, (32, 256, 4, 2, 2)),
                            (7, 70, 1100, (64, 128, 4, 4, 4)), (48, 70, 600, None)):
        x = (torch.randn(m, k + 8, generator=g) * 4).half().to(DEVICE)[:, :k]  # rows k + 8 apart
        w = (torch.randn(n, k, generator=g) * 0.05).half()
        b = torch.randn(n, generator=g).half() if bias else None
        y = skinny_linear(x, w.to(DEVICE), None if b is None else b.to(DEVICE), config=config)
        ref = reference(x.cpu(), w, None, b, False).to(DEVICE)
        assert y.shape == (m, n) and y.dtype == torch.float16
        assert torch.allclose(y.double(), ref, rtol=2**-10, atol=2**-10 * ref.abs().max().item()), (m, n, k)
    assert not any(counters.any() for counters in skinny_gemm._counters.values())


@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_rows_and_silu_and_mul_rows(has_residual):
    """The chain's norm and gate kernels against layernorm.RMSNorm and activation.silu_and_mul: the
    residual sum bit for bit, the rest within two roundings of fp16 (the float32 sums and exp
    are not computed in the same order or with the same instructions)."""
    g = torch.Generator().manual_seed(40 + has_residual)
    for m, k in ((3, 100), (9, 1024)):
        x, res = (torch.randn(m, k, generator=g) * 3).half(), (torch.randn(m, k, generator=g) * 3).half()
        res = res if has_residual else None
        norm_w = (1 + torch.randn(k, generator=g) * 0.2).half()
        y, r = rms_norm_rows(x.to(DEVICE), None if res is None else res.to(DEVICE), norm_w.to(DEVICE), 1e-6)
        y_ref, r_ref = normed(x, res, norm_w, 1e-6)
        assert torch.equal(r.cpu(), r_ref)
        assert torch.allclose(y.cpu().float(), y_ref.float(), rtol=2**-9, atol=2**-14), (m, k)
        gate_up = (torch.randn(m, 2 * k, generator=g) * 3).half()
        assert torch.allclose(silu_and_mul_rows(gate_up.to(DEVICE)).cpu().float(), silu_and_mul(gate_up.float()).half().float(),
                              rtol=2**-9, atol=2**-14), (m, k)


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU")
@pytest.mark.parametrize("k,n", [(1024, 4096), (2048, 1024), (3072, 1024), (1024, 6144), (896, 1152), (4096, 6144),
                                 (12288, 4096)])
@pytest.mark.parametrize("m", [2, 7, 16, 32, 48, 64])
def test_linear_few_rows_on_the_gpu(k, n, m):
    """A linear method and norm_linear() at 2-64 rows of bf16 take skinny_gemm.py's kernels with the default
    tiling (K split where N is narrow; gated for down_proj's K), equal to the float64 product to
    bf16's rounding of the output (2^-8), the same bits on a second run (the split's sum has a
    fixed order), and the residual sum as RMSNorm returns it."""
    g = torch.Generator("cuda").manual_seed(k + n + m)
    gated = k == 3072
    x, res = (torch.randn(2, m, (2 if gated else 1) * k, device="cuda", generator=g) * 3).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    assert few_rows(x)  # the skinny kernels, not cuBLAS
    y = linear(x, w, None, None, gated)
    ref = reference(x, w, None, None, gated)
    assert torch.allclose(y.double(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())
    assert torch.equal(y, linear(x, w, None, None, gated))
    if not gated:
        check_norm_linear(x, res, w, g)
