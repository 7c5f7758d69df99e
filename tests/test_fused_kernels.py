"""Fused Triton kernels against the torch layers they replace (Triton's interpreter without CUDA)."""
import pytest
import torch

pytest.importorskip("triton")
from nanovllm.layers.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.qk_norm_rope_kernel import qk_norm_rope  # noqa: E402
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
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(8, 128, 256), (2, 64, 16), (3, 32, 16)])
def test_qk_norm_rope_writes_the_kv_cache(dtype, kv_heads, head_dim, block_size):
    """With kv_cache the kernel also writes the rotated k and v rows at their slots (-1 skipped),
    exactly as the torch backend's store does with the same k; other slots stay untouched."""
    g = torch.Generator().manual_seed(kv_heads * head_dim)
    T, heads, num_blocks = 41, 2 * kv_heads, 7
    rope = RotaryEmbedding(Cfg(), head_dim, 4096).to(DEVICE)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim)  # strided, as in the model
    positions = torch.randint(0, 4096, (T,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::4] = -1
    slots = slots.to(DEVICE)
    norms = (RMSNorm(head_dim).to(DEVICE, dtype), RMSNorm(head_dim).to(DEVICE, dtype))
    caches = [torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
              for _ in range(4)]
    qk_norm_rope(positions, q, k, rope.cos_sin_cache, norms[0].weight, norms[1].weight, 1e-6,
                 kv_cache=(v, caches[0], caches[1], slots))
    backend = TorchBackend()
    backend.k_caches, backend.v_caches = [caches[2]], [caches[3]]
    backend.store_kv(0, k, v, slots)  # k is rotated in place by now
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert caches[0].isnan().sum() == (num_blocks * block_size - (slots >= 0).sum()) * kv_heads * head_dim
