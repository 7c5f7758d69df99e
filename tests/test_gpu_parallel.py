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


def _row_parallel_rank(rank: int, store_path: str):
    from nanovllm.layers.linear import RowParallelLinear, linear
    from nanovllm.parallel.process_group import init_process_group, leave_process_group
    from nanovllm.parallel.state import TensorParallel
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_process_group(rank, 2, store_path, device, (256, 1024), torch.bfloat16)
    torch.manual_seed(rank)  # each rank its own shard
    for gated in (False, True):
        layer = RowParallelLinear(3072 if gated else 2048, 1024, TensorParallel(rank, 2), gated=gated)  # K 1536 or 1024
        layer = layer.to(device, torch.bfloat16)
        torch.nn.init.normal_(layer.weight, std=0.05)
        # 1 row: the GEMV; 5 and 64: the skinny kernels; 100 and 256: cuBLAS; 300: past the buffer (NCCL)
        for rows in (1, 5, 64, 100, 256, 300):
            x = torch.randn(rows, layer.weight.size(1) * (2 if gated else 1), device=device, dtype=torch.bfloat16)
            y = layer(x)
            reference = linear(x, layer.weight, None, None, gated)  # this rank's partial sums, by the same kernel
            torch.distributed.all_reduce(reference)  # through NCCL: two bf16 addends, rounded once either way
            assert torch.equal(y, reference), (gated, rows, (y - reference).abs().max().item())
    leave_process_group({})


def test_row_parallel_symmetric_all_reduce(tmp_path):
    """A row-parallel layer's partial sums written into the symmetric buffer and summed there equal
    NCCL's sum of the same products, at every row count (each product kernel writes into the buffer)."""
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
