"""The one-row product kernel (layers/gemv.py) against float64 products on awkward sizes: partial
tiles in N and K, 16-bit and float8 weights, bias, and SwiGLU's silu(gate) * up fused into the
loads. Without CUDA it runs in Triton's interpreter, in float16 (the interpreter multiplies
bfloat16 as integers); on CUDA also in bfloat16 at Qwen3-0.6B's and -8B's shapes through
linear.linear, as the decode step of one sequence runs it."""
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.layers.activation import silu_and_mul  # noqa: E402
from nanovllm.layers.fp8 import quantize_fp8  # noqa: E402
from nanovllm.layers.gemv import gemv  # noqa: E402
from nanovllm.layers.linear import linear  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


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


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("k,n", [(1024, 4096), (3072, 1024), (4096, 6144), (12288, 4096)])
@pytest.mark.parametrize("fp8", [False, True])
def test_linear_one_row_on_the_gpu(k, n, fp8):
    """linear() at one row of bf16 takes the GEMV with its default tiling (gated for down_proj's
    K), equal to the float64 product to bf16's rounding of the output (2^-8)."""
    g = torch.Generator("cuda").manual_seed(k + n)
    gated = k in (3072, 12288)
    x = torch.randn(1, (2 if gated else 1) * k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    w, scale = quantize_fp8(w) if fp8 else (w.bfloat16(), None)
    y = linear(x, w, scale, None, gated)
    ref = reference(x, w, scale, None, gated)
    assert torch.allclose(y.double(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())
