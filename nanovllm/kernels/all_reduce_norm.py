"""The all-reduce of two tensor-parallel ranks fused with the residual add and RMSNorm after it:
one Triton kernel that pushes this rank's partial sums over NVLink into the peer's box in
symmetric memory and reads the peer's from its own (process_group.all_reduce_rms_norm sets it
up), or, in a prefill step, reads them from local memory the peer's copy engine wrote
(signal_kernel, wait_kernel). It replaces the copy into a symmetric buffer, the two-shot
all-reduce, the copy out and the norm (20.6 -> 12.6 us at 256 rows of 4096, 2 x H100,
docs/perf-log.md, 2026-11-25). Pushing rather than meeting through flags and then reading the
peer's memory: 8.29 -> 5.68 us at 256 rows of 2048, 3.79 -> 2.33 at one row (2 x H200,
benchmarks/all_reduce_norm.py; docs/perf-log.md, 2026-11-28)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_args, pdl_start


# A box row's empty mark: -0.0, bits 0x8000 in bfloat16 and float16. A rank pushes its partial sums
# with -0.0 made +0.0, so a value never reads as the mark; both ranks add the two so made.
EMPTY_BITS = -0x8000
_EMPTY = tl.constexpr(EMPTY_BITS)


@triton.jit
def all_reduce_rms_norm_kernel(own_ptr, box_ptr, peer_box_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, K, eps,
                               PUSH: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr,
                               PDL: tl.constexpr):
    """Grid (rows,). Row r: s = own[r] + peer's[r] rounded to the model dtype (what an all-reduce of
    two addends gives, the same on both ranks: IEEE addition commutes), r = s + res[r] rounded
    (HAS_RESIDUAL; else r = s), res_out[r] = r, y[r] = (r / rms(r)) rounded, times w, as
    layernorm.RMSNorm computes it.

    PUSH: the program stores its row of own into the peer's box (peer_box, over NVLink), then reads
    its own box until no element of the row is the empty mark (the peer's program of the row has
    pushed it), and marks the row empty again. Each element is its own flag (the Lamport-style
    one-shot all-reduce of TensorRT-LLM), so the peer's sums arrive in one one-way trip, with no
    flag to exchange first and no read over NVLink afterwards. A box is pushed to again only
    after it was emptied: the peer pushes into it two calls later (consecutive calls use
    different boxes), after it has seen this rank's push of the call between, which this rank
    made after this kernel ended.

    Without PUSH the peer's partial sums are already here (box: local memory the peer's copy engine
    wrote, after a wait_kernel)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    off = row.to(tl.int64) * K + cols
    own = tl.load(own_ptr + off, mask=mask, other=0.0)
    if PUSH:
        own = tl.where(own == 0, tl.zeros_like(own), own)  # -0.0 -> +0.0
        tl.store(peer_box_ptr + off, own, mask=mask)
        box = box_ptr + off
        # volatile: from L2, where the peer's stores land. The loop carries no tensor (as in gemv.py's
        # _lora_delta): the row is read once more after it
        while tl.sum((tl.load(box, mask=mask, other=0.0, volatile=True).to(tl.int16, bitcast=True)
                      == _EMPTY).to(tl.int32), 0) > 0:
            pass
        peer = tl.load(box, mask=mask, other=0.0, volatile=True)
        tl.store(box, tl.full([BLOCK_K], _EMPTY, tl.int16).to(own.dtype, bitcast=True), mask=mask)
    else:
        peer = tl.load(box_ptr + off, mask=mask, other=0.0, cache_modifier=".cv")
    r = (own.to(tl.float32) + peer.to(tl.float32)).to(own.dtype)
    if HAS_RESIDUAL:
        r = (r.to(tl.float32) + tl.load(res_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(own.dtype)
    tl.store(res_out_ptr + off, r, mask=mask)
    rf = r.to(tl.float32)
    normed = (rf * tl.rsqrt(tl.sum(rf * rf, 0) / K + eps)).to(r.dtype)
    tl.store(y_ptr + off, normed * tl.load(w_ptr + cols, mask=mask, other=0.0), mask=mask)


def all_reduce_rms_norm_2(own: torch.Tensor, box: torch.Tensor, peer_box: torch.Tensor | None,
                          residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """own: [rows, K] this rank's partial sums, contiguous, bfloat16 or float16 where peer_box is
    given; box: [>= rows, K] where the peer's partial sums arrive, peer_box: [>= rows, K] the peer's
    box mapped here (symmetric memory), both all empty marks (EMPTY_BITS) before the first call and
    left so; or peer_box None where box holds the peer's partial sums already (wait_kernel);
    residual: [rows, K] or None; weight: [K]. Returns (RMSNorm(r) * weight, r) for r = own + peer
    (+ residual), both [rows, K] in own's dtype. With peer_box, both ranks must call it with the
    same rows, else one waits forever."""
    rows, k = own.shape
    y, r = torch.empty_like(own), torch.empty_like(own)
    push = peer_box is not None
    assert not push or own.dtype in (torch.bfloat16, torch.float16)
    all_reduce_rms_norm_kernel[(rows,)](
        own, box, peer_box if push else own, own if residual is None else residual, weight, y, r, k, eps,
        PUSH=push, HAS_RESIDUAL=residual is not None, BLOCK_K=triton.next_power_of_2(k),
        # 256 rows of 4096: 12.4 us, 13.3 with 8 warps (2 x H100, docs/perf-log.md, 2026-11-25), measured when
        # the rows met at system-scope flags and pulled the peer's sums; not swept again for the push
        num_warps=4,
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
