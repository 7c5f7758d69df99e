"""Fused Triton kernels against the torch layers they replace (Triton's interpreter without CUDA)."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from nanovllm.engine.kv_cache import KVCacheSpec  # noqa: E402
from nanovllm.layers.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.kernels.fp8_gemm import _round_to_e4m3  # noqa: E402
from nanovllm.kernels.qk_norm_rope import qk_norm_rope, rope_store_kv  # noqa: E402
from nanovllm.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Cfg:
    rope_theta = 1e6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (14, 2, 64), (3, 1, 32)])
def test_qk_norm_rope_matches_torch(dtype, norm, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads * head_dim + norm)
    T = 37
    rope = RotaryEmbedding(Cfg(), head_dim, 4096).to(DEVICE)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (T,), generator=g).to(DEVICE)
    norms = None
    if norm:
        norms = (RMSNorm(head_dim).to(DEVICE, dtype), RMSNorm(head_dim).to(DEVICE, dtype))
        for n in norms:
            n.weight.data = torch.randn(head_dim, generator=g).to(DEVICE, dtype)
    # reference: the torch path in float32
    fnorms = None if norms is None else tuple(RMSNorm(head_dim).to(DEVICE) for _ in range(2))
    if norms:
        for f, n in zip(fnorms, norms):
            f.weight.data = n.weight.data.float()
    cos, sin = rope.cos_sin_cache[positions].unsqueeze(1).chunk(2, -1)
    rq, rk = (fnorms[0](q.float()), fnorms[1](k.float())) if norm else (q.float(), k.float())
    rq, rk = rope._rotate(rq, cos, sin), rope._rotate(rk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    qk_norm_rope(positions, q, k, rope.cos_sin_cache, *((norms[0].weight, norms[1].weight, 1e-6) if norm else ()))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for out, ref in ((q, rq), (k, rk)):
        assert ((out.float() - ref).norm() / ref.norm()).item() < tol
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(8, 128, 256), (2, 64, 16), (3, 32, 16)])
def test_qk_norm_rope_writes_the_kv_cache(dtype, fp8, kv_heads, head_dim, block_size):
    """With kv_cache the kernel also writes the rotated k and v rows at their slots (-1 skipped),
    exactly as the torch backend's store does with the same k (a float8 cache: the same values
    and scales); other slots stay untouched. rope_store_kv writes the same cache and leaves q, k
    and v as they were."""
    g = torch.Generator().manual_seed(kv_heads * head_dim)
    T, heads, num_blocks = 41, 2 * kv_heads, 7
    rope = RotaryEmbedding(Cfg(), head_dim, 4096).to(DEVICE)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    qkv[3] = 0.0  # a zero vector: scale > 0, values 0
    qkv[5, -head_dim:] *= 1000  # one large V vector (for its own scale)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim)  # strided, as in the model
    positions = torch.randint(0, 4096, (T,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::4] = -1
    slots = slots.to(DEVICE)
    norms = (RMSNorm(head_dim).to(DEVICE, dtype), RMSNorm(head_dim).to(DEVICE, dtype))
    caches = [KVCacheSpec(1, block_size, kv_heads, head_dim, torch.float8_e4m3fn if fp8 else dtype).allocate(
        num_blocks, DEVICE) for _ in range(3)]
    for c in caches:
        c.data.view(torch.uint8).fill_(0xFF)  # NaN in every float dtype; unwritten slots stay so
        if fp8:
            c.scales.fill_(float("nan"))
    ours, torchs, k_only = TorchBackend(), TorchBackend(), TorchBackend()
    ours.bind_kv_cache(caches[0])
    torchs.bind_kv_cache(caches[1])
    k_only.bind_kv_cache(caches[2])
    qkv_before = qkv.clone()
    rope_store_kv(positions, k, rope.cos_sin_cache, norms[1].weight, 1e-6,
                  (v, k_only.k_caches[0], k_only.v_caches[0], k_only.k_scales[0], k_only.v_scales[0], slots))
    assert torch.equal(qkv, qkv_before)
    qk_norm_rope(positions, q, k, rope.cos_sin_cache, norms[0].weight, norms[1].weight, 1e-6,
                 kv_cache=(v, ours.k_caches[0], ours.v_caches[0], ours.k_scales[0], ours.v_scales[0], slots))
    torchs.store_kv(0, k, v, slots)  # k is rotated in place by now
    for ours_t, torch_t in ((caches[0].data, caches[1].data), (caches[0].scales, caches[1].scales),
                            (caches[2].data, caches[0].data), (caches[2].scales, caches[0].scales)):
        if ours_t is not None:
            a, b = ours_t.float().nan_to_num(7.0), torch_t.float().nan_to_num(7.0)
            assert torch.equal(a, b), (int((a != b).sum()), a[a != b][:4].tolist(), b[a != b][:4].tolist())
    unwritten = caches[0].data[0, 0].float().isnan().all(-1).sum().item()
    assert unwritten == (num_blocks * block_size - (slots >= 0).sum()) * kv_heads
    if fp8:  # token 3's zero vectors
        assert caches[0].scales[0, 0].view(-1, kv_heads)[slots[3]].gt(0).all()
        assert caches[0].data[:, 0].view(2, -1, kv_heads, head_dim)[:, slots[3]].float().eq(0).all()


@triton.jit
def _round_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, _round_to_e4m3(tl.load(x_ptr + offs)))


def test_round_to_e4m3_is_the_float8_cast():
    """The store kernel's own rounding equals torch's float32 -> float8 e4m3 cast (nearest, ties to
    even) on every finite e4m3 value, every midpoint between neighbours (ties), subnormals, and
    random values up to 448."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 .. 448
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mid, torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 100,
                   torch.rand(500, generator=torch.Generator().manual_seed(1)) * 0.03 - 0.015]).clamp(-448, 448)
    n = triton.next_power_of_2(x.numel())
    x = torch.nn.functional.pad(x, (0, n - x.numel())).to(DEVICE)
    y = torch.full_like(x, float("nan"))
    _round_kernel[(1,)](x, y, N=n)
    assert torch.equal(y, x.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float16])
@pytest.mark.parametrize("rows,k,has_residual,push", [
    (1, 1024, True, True), (5, 1000, True, True), (33, 4096, False, True),
    (7, 1000, True, False), (2, 4096, False, False)])  # without push: a prefill step's, sent by copy engine
def test_all_reduce_rms_norm_kernel(dtype, rows, k, has_residual, push):
    """TP=2's all-reduce + residual add + RMSNorm kernel on one device, the peer's push into this
    rank's box made beforehand (float16 in the interpreter, which rounds bf16 wrongly), and partial
    sums with -0.0 among them: the residual sum exact, the output within two roundings (the
    normalised value's and the weight product's) of the float32 norm of that sum, this rank's rows
    pushed into the peer's box with -0.0 as +0.0, and its own box's rows marked empty again, the
    rows past them untouched; without push (peer_box None) the same values from a box left as it
    is."""
    from nanovllm.kernels.all_reduce_norm import EMPTY_BITS, all_reduce_rms_norm_2
    g = torch.Generator().manual_seed(rows * k)
    own, peer, res = (torch.randn(rows, k, generator=g).to(DEVICE, dtype) for _ in range(3))
    own[:, ::7] = -0.0
    peer[:, ::5] = 0.0  # as pushed: never -0.0
    w = torch.randn(k, generator=g).to(DEVICE, dtype)
    empty = torch.full((rows + 3, k), EMPTY_BITS, dtype=torch.int16, device=DEVICE).view(dtype)
    box, peer_box = empty.clone(), empty.clone()
    box[:rows] = peer
    y, r = all_reduce_rms_norm_2(own, box, peer_box if push else None, res if has_residual else None, w, 1e-6)
    r_ref = (own.float() + peer.float()).to(dtype)
    if has_residual:
        r_ref = (r_ref.float() + res.float()).to(dtype)
    assert torch.equal(r.view(torch.int16), r_ref.view(torch.int16))  # bitwise: +0.0 where both addends are zeros
    rf = r_ref.float()
    y_ref = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    info = torch.finfo(dtype)  # two roundings: of unit roundoff eps / 2 each, or of half a subnormal step
    assert ((y.float() - y_ref).abs() <= 1.01 * info.eps * y_ref.abs() + info.tiny * info.eps).all()
    if push:
        assert torch.equal(box.view(torch.int16), empty.view(torch.int16))
        assert torch.equal(peer_box[:rows].view(torch.int16), (own + 0.0).view(torch.int16))  # -0.0 + 0.0 = +0.0
        assert torch.equal(peer_box[rows:].view(torch.int16), empty[rows:].view(torch.int16))
    else:
        assert torch.equal(box[:rows], peer) and torch.equal(peer_box.view(torch.int16), empty.view(torch.int16))
