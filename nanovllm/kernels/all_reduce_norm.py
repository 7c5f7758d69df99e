"""The all-reduce of two tensor-parallel ranks fused with the residual add and RMSNorm after it:
one Triton kernel that reads the peer's partial sums over NVLink from symmetric memory
(process_group.all_reduce_rms_norm sets it up), or, in a prefill step, from local memory the
peer's copy engine wrote (signal_kernel, wait_kernel). It replaces the copy into the symmetric buffer,
the two-shot all-reduce, the copy out and the norm: 20.6 -> 12.6 us at 256 rows of 4096 and
13.9 -> 7.9 at 256 of 1024 (2 x H100, in CUDA graphs; docs/perf-log.md, 2026-11-25)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_args, pdl_start


@triton.jit
def all_reduce_rms_norm_kernel(own_ptr, peer_ptr, flags_ptr, peer_flags_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
                               K, eps, RANK: tl.constexpr, MEET: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                               BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows,). Row r: s = own[r] + peer[r] rounded to the model dtype (what an all-reduce of
    two addends gives, the same on both ranks: IEEE addition commutes), r = s + res[r] rounded
    (HAS_RESIDUAL; else r = s), res_out[r] = r, y[r] = (r / rms(r)) rounded, times w, as
    layernorm.RMSNorm computes it.

    First the program meets the peer's program of the same row: it sets the peer's flag [r, RANK]
    from 0 to 1 (spinning while the peer has not yet consumed the previous call's signal), then
    waits for its own flag [r, 1 - RANK] to be 1 and sets it back to 0. The release/acquire pair at
    system scope makes the peer's partial sums, written before its signal, visible here. One meeting
    per call suffices because consecutive calls read different buffers (process_group's slots): a
    rank that passed call n's meeting knows its peer has finished call n - 1, the last to read the
    buffer call n + 1 overwrites.

    Without MEET the peer's partial sums are already here (peer_ptr: local memory the peer's copy
    engine wrote, after a wait_kernel), and the flags are not touched."""
    pdl_start(PDL)
    row = tl.program_id(0)
    if MEET:
        while tl.atomic_cas(peer_flags_ptr + row * 2 + RANK, 0, 1, sem="release", scope="sys") != 0:
            pass
        while tl.atomic_cas(flags_ptr + row * 2 + 1 - RANK, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    off = row.to(tl.int64) * K + cols
    own = tl.load(own_ptr + off, mask=mask, other=0.0)
    peer = tl.load(peer_ptr + off, mask=mask, other=0.0, cache_modifier=".cv")  # fetched anew over NVLink
    r = (own.to(tl.float32) + peer.to(tl.float32)).to(own.dtype)
    if HAS_RESIDUAL:
        r = (r.to(tl.float32) + tl.load(res_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(own.dtype)
    tl.store(res_out_ptr + off, r, mask=mask)
    rf = r.to(tl.float32)
    normed = (rf * tl.rsqrt(tl.sum(rf * rf, 0) / K + eps)).to(r.dtype)
    tl.store(y_ptr + off, normed * tl.load(w_ptr + cols, mask=mask, other=0.0), mask=mask)


def all_reduce_rms_norm_2(own: torch.Tensor, peer: torch.Tensor, flags: torch.Tensor | None,
                          peer_flags: torch.Tensor | None, rank: int, residual: torch.Tensor | None,
                          weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """own, peer: [rows, K] this rank's and the other rank's partial sums (the peer's mapped from
    its symmetric memory), contiguous; flags, peer_flags: [>= rows, 2] int32, this rank's and the
    peer's meeting flags (zero before the first call), or both None where peer is local memory the
    peer has finished writing (wait_kernel); rank: 0 or 1; residual: [rows, K] or None;
    weight: [K]. Returns (RMSNorm(r) * weight, r) for r = own + peer (+ residual), both [rows, K] in
    own's dtype. With flags, both ranks must call it with the same rows, else one waits forever."""
    rows, k = own.shape
    y, r = torch.empty_like(own), torch.empty_like(own)
    meet = flags is not None
    all_reduce_rms_norm_kernel[(rows,)](
        own, peer, flags if meet else own, peer_flags if meet else own, own if residual is None else residual,
        weight, y, r, k, eps, RANK=rank, MEET=meet, HAS_RESIDUAL=residual is not None,
        BLOCK_K=triton.next_power_of_2(k),
        num_warps=4,  # 256 rows of 4096: 12.4 us, 13.3 with 8 warps (2 x H100, docs/perf-log.md, 2026-11-25)
        **pdl_args(own.device))
    return y, r


@triton.jit
def signal_kernel(peer_flag_ptr):
    """Grid (1,): set the peer's flag from 0 to 1 (spinning while it has not consumed the last
    signal), releasing at system scope what this stream wrote before (the copy engine's copies)."""
    while tl.atomic_cas(peer_flag_ptr, 0, 1, sem="release", scope="sys") != 0:
        pass


@triton.jit
def wait_kernel(flag_ptr):
    """Grid (1,): wait for the peer's signal (flag 1), acquire at system scope, set the flag back to 0."""
    while tl.atomic_cas(flag_ptr, 1, 0, sem="acquire", scope="sys") != 1:
        pass
