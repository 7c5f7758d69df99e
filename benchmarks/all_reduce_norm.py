"""TP=2's all-reduce + residual add + RMSNorm (process_group.TPGroup.all_reduce_rms_norm) alone, on
two GPUs: a CUDA graph of --calls sums in the decoder's order of slots (the embedding's, then
o_proj's and down_proj's in turn), each of rows x hidden bf16 partial sums already in their buffer,
us per call on rank 0 (the ranks meet in every call, so they run at one pace). Each size is first
checked against NCCL's sum of the same partial sums.

    PYTHONPATH=. python benchmarks/all_reduce_norm.py [--rows 1 16 64 256] [--hidden 2048 4096]
"""
import argparse
import tempfile

import torch

from benchmarks.graph_timer import graph_us


@torch.inference_mode()
def _rank(rank: int, store: str, rows_list: list[int], hidden: int, calls: int):
    from nanovllm.distributed.process_group import DOWN_PROJ_SLOT, EMBEDDING_SLOT, O_PROJ_SLOT, init_process_group
    from nanovllm.layers.layernorm import RMSNorm
    device, dtype = torch.device("cuda", rank), torch.bfloat16
    torch.cuda.set_device(device)
    group = init_process_group(rank, 2, store, device, (max(rows_list), 8, hidden), dtype)
    assert group.symmetric is not None, "no symmetric memory between the two GPUs"
    norm = RMSNorm(hidden).to(device, dtype)
    torch.manual_seed(0)
    torch.nn.init.normal_(norm.weight)
    slots = [EMBEDDING_SLOT] + [O_PROJ_SLOT, DOWN_PROJ_SLOT] * ((calls - 1) // 2)
    for rows in rows_list:
        torch.manual_seed(1 + rank)
        parts = {s: group.partial_sums_buffer(rows, dtype, s) for s in set(slots)}
        for p in parts.values():
            p.normal_()
        total = parts[EMBEDDING_SLOT].float()
        torch.distributed.all_reduce(total)
        _, r = group.all_reduce_rms_norm(parts[EMBEDDING_SLOT], None, norm)
        assert torch.equal(r, total.to(dtype)), (hidden, rows)
        residual = torch.randn(rows, hidden, device=device, dtype=dtype)

        def chain():
            res = residual
            for s in slots:
                _, res = group.all_reduce_rms_norm(parts[s], res, norm)

        us = graph_us(chain) / len(slots)
        if rank == 0:
            print(f"hidden {hidden:5d}  rows {rows:4d}: {us:6.2f} us a call", flush=True)
    group.leave({})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--calls", type=int, default=97, help="sums per graph (Qwen3-30B-A3B's step: 97)")
    args = p.parse_args()
    for hidden in args.hidden:  # a process pair each: a process makes one symmetric-memory rendezvous
        with tempfile.TemporaryDirectory() as d:
            torch.multiprocessing.spawn(_rank, args=(f"{d}/store", args.rows, hidden, args.calls), nprocs=2)
