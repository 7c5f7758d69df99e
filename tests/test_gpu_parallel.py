"""Tensor and data parallelism on two GPUs (skipped with fewer), NCCL and CUDA graphs on.

Dummy Qwen3-8B gives the same greedy tokens with TP=2 as with TP=1, and DP=2 the same as one
replica. In float32: in bf16 the ranks' partial sums are rounded before the all-reduce (and a
replica's smaller batches pick other GEMM kernels), which moves logits by ~1e-2 and flips
random-weight near-ties (benchmarks/tp_smoke.py prints how often); in float32 those moves are
~1e-6 and the greedy tokens must be identical."""
import gc
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

NUM_TOKENS = 16


def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (3, 50, 129, 300, 511, 1000, 1500, 17)]


def greedy(model, **engine_args):
    from nanovllm import LLM, SamplingParams
    llm = LLM(model, load_format="dummy", dtype="float32", max_model_len=2048, gpu_memory_utilization=0.6,
              **engine_args)
    outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.token_ids for o in outputs]


def test_tensor_parallel_8b_matches_one_gpu():
    assert greedy("Qwen/Qwen3-8B", tensor_parallel_size=2) == greedy("Qwen/Qwen3-8B")


@torch.inference_mode()  # as the engine runs (a product written to a buffer takes no autograd)
def _row_parallel_rank(rank: int, store_path: str):
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.linear import RowParallelLinear
    from nanovllm.distributed.process_group import SEND_CHUNK_MIN_ROWS, SEND_CHUNKS, init_process_group
    from nanovllm.distributed.state import TensorParallel
    device, dtype = torch.device("cuda", rank), torch.bfloat16
    torch.cuda.set_device(device)
    group = init_process_group(rank, 2, store_path, device, (256, 4100, 1024), dtype)
    torch.manual_seed(0)  # the norm's weight: the same on both ranks
    norm = RMSNorm(1024).to(device, dtype)
    torch.nn.init.normal_(norm.weight)
    torch.manual_seed(1 + rank)  # each rank its own shards
    tp = TensorParallel(rank, 2, group)
    # the decoder's order: the embedding's slot with no residual, then o_proj's and down_proj's in turn
    layers = [RowParallelLinear(2048, 1024, tp, slot=2)] + [RowParallelLinear(2048, 1024, tp, slot=0),
                                                            RowParallelLinear(3072, 1024, tp, slot=1, gated=True)] * 3
    for layer in layers[:3]:
        layer.to(device, dtype)
        torch.nn.init.normal_(layer.weight, std=0.05)
    eps = torch.finfo(dtype).eps
    # 1 row: the GEMV; 5 and 64: the skinny kernels; 100 and 256: cuBLAS; 300 and 4100: sent through the
    # copy engines (in 1 and 4 chunks); 4200: past the inboxes (NCCL)
    for rows in (1, 5, 64, 100, 256, 300, 4100, 4200):
        residual = None
        for layer in layers:
            x = torch.randn(rows, layer.weight.size(1) * (2 if layer.gated else 1), device=device, dtype=dtype)
            chunks = max(1, min(SEND_CHUNKS, rows // SEND_CHUNK_MIN_ROWS)) if 256 < rows <= 4100 else 1
            own = torch.cat([layer.quant_method.apply(layer, c, None, layer.gated)  # as the layer chunks it
                             for c in x.tensor_split([rows * i // chunks for i in range(1, chunks)])])
            partial = layer(x)
            buffer = group.partial_sums_buffer(rows, dtype, layer.slot)
            assert (buffer is not None and partial.data_ptr() == buffer.data_ptr()) == (rows <= 256), rows
            assert torch.equal(partial, own)  # the same kernels
            total = own.float()
            torch.distributed.all_reduce(total)  # two bf16 addends: exact in float32, then rounded once
            r_ref = total.to(dtype) if residual is None else (total.to(dtype).float() + residual.float()).to(dtype)
            y, r = group.all_reduce_rms_norm(partial, residual, norm)
            assert torch.equal(r, r_ref), (rows, layer.slot, (r.float() - r_ref.float()).abs().max().item())
            if rows > 4100:  # NCCL's sum, then the model's own norm
                summed = total.to(dtype)
                assert torch.equal(y, norm(summed) if residual is None else norm(summed, residual)[0])
            else:  # the kernel: two roundings (the normalised value's, the weight product's) off float32
                rf = r_ref.float()
                y_ref = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
                assert ((y.float() - y_ref).abs() <= 1.01 * eps * y_ref.abs()).all(), (rows, layer.slot)
            residual = r
    group.leave({})


def test_row_parallel_all_reduce_rms_norm(tmp_path):
    """The row-parallel products' partial sums summed with the residual add and RMSNorm after them,
    in the decoder's order of symmetric buffers: at up to 256 rows each product kernel writes into
    its buffer and one kernel sums and normalises, its sum NCCL's exactly and its output within two
    bf16 roundings of the float32 norm of that sum; at 300 and 4100 rows (a prefill step's) the
    products send their partial sums to the peer through the copy engines, chunk by chunk, and one
    kernel sums and normalises them, within the same bounds; past the inboxes (4200 rows) NCCL sums
    and the model's norm runs."""
    torch.multiprocessing.spawn(_row_parallel_rank, args=(str(tmp_path / "store"),), nprocs=2)


def test_data_parallel_matches_one_replica():
    assert greedy("Qwen/Qwen3-0.6B", data_parallel_size=2) == greedy("Qwen/Qwen3-0.6B")


def test_tensor_parallel_engines_end_cleanly(tmp_path):
    """A deleted TP engine leaves its NCCL group (a second one can start in the same process), and
    a process that exits with a TP engine alive ends instead of hanging in NCCL's teardown."""
    script = tmp_path / "two_engines.py"
    script.write_text(textwrap.dedent("""
        import gc
        from nanovllm import LLM, SamplingParams

        def run():
            llm = LLM("Qwen/Qwen3-0.6B", load_format="dummy", tensor_parallel_size=2, gpu_memory_utilization=0.3)
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            return llm, [o.token_ids for o in llm.generate([[1, 2, 3], list(range(100, 400))], params, use_tqdm=False)]

        if __name__ == "__main__":
            llm, first = run()
            del llm
            gc.collect()
            llm, second = run()
            print("same tokens:", first == second, flush=True)
        """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "same tokens: True" in result.stdout
