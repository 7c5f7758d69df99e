#!/usr/bin/env bash
# Everything the GPU must show, in one run: kernel and engine tests, decode attention
# bandwidth, bench.py. Logs go to $OUT (or ./gpu_logs). Stages: all (default), tests, bench,
# parallel (two GPUs: TP/DP tests, tp_smoke.py, bench.py at TP 1/2 on Qwen3-8B and DP 1/2),
# moe (one GPU: the MoE kernel and engine tests, benchmarks/moe.py, bench.py on Qwen3-30B-A3B:
# default workload, one sequence, one sequence with float8 weights), moe-parallel (two GPUs:
# bench.py on Qwen3-30B-A3B at TP 1 and 2, and 2 with expert parallelism; the MoE engine
# tests' tp2 and ep2 cases), lora (LoRA's tests, its kernels' cost per layer and per one-row product,
# bench.py with and without adapters: throughput and latency), structured (structured outputs:
# its tests, the host's mask work per step, bench.py --structured json all rows / half the rows /
# with xgrammar; needs llguidance, xgrammar and jsonschema, and a Qwen3 tokenizer folder,
# $TOKENIZER, default ./qwen3-tokenizer), spec (speculative decoding's tests; bench.py one sequence
# on Qwen3-0.6B and Qwen3-8B without and with replayed drafts at 0.7 acceptance, k = 4, and Qwen3-8B
# with a Qwen3-0.6B draft model (random weights: acceptance ~0, the draft's share of a step is what
# it shows); 256 greedy sequences without and with replay and n-gram).
set -uo pipefail
out=${OUT:-gpu_logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
stage=${1:-all}
if [[ $stage == all || $stage == tests ]]; then
  python -m pytest -q ${PYTEST_ARGS:-} ${TESTS:-tests/test_attention_kernels.py tests/test_gemv.py tests/test_gpu_engine.py tests/test_gpu_parallel.py} 2>&1 | tee "$out/tests.log" | tail -15
fi
if [[ $stage == all || $stage == bench ]]; then
  python benchmarks/decode_attention.py 2>&1 | tee "$out/decode_attention.log"
  python bench.py --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | grep -v Warn | tail -${BENCH_TAIL:-5}
fi
if [[ $stage == parallel ]]; then
  python -m pytest -q -s -o faulthandler_timeout=240 tests/test_gpu_parallel.py 2>&1 | tee "$out/parallel_tests.log" | tail -8
  python benchmarks/tp_smoke.py --dtype float32 2>&1 | grep -v Warn | tee "$out/tp_smoke_fp32.log"
  python benchmarks/tp_smoke.py 2>&1 | grep -v Warn | tee "$out/tp_smoke.log"
  for run in "tp1 --model qwen3-8b --tp 1" "tp2 --model qwen3-8b --tp 2" "dp1" "dp2 --dp 2"; do
    set -- $run
    python bench.py --json "$out/$1.json" "${@:2}" 2>&1 | grep -v Warn | tee "$out/$1.log" | tail -1
  done
fi
if [[ $stage == lora ]]; then
  python -m pytest -q tests/test_lora_kernels.py tests/test_lora_gpu.py 2>&1 | tee "$out/lora_tests.log" | tail -15
  python benchmarks/lora_kernels.py 2>&1 | grep -v Warn | tee "$out/lora_kernels.log"
  python benchmarks/gemv_lora.py 2>&1 | grep -v Warn | tee "$out/gemv_lora.log"
  for run in "base" "lora8 --lora 8 --lora-rank 16" "latency --latency" "latency_lora1 --latency --lora 1 --lora-rank 16" \
             "latency_lora1_qv --latency --lora 1 --lora-rank 16 --lora-targets q_proj v_proj"; do
    set -- $run
    python bench.py --json "$out/$1.json" "${@:2}" 2>&1 | grep -v Warn | tee "$out/$1.log" | tail -2
  done
fi
if [[ $stage == spec ]]; then
  python -m pytest -q ${PYTEST_ARGS:-} tests/test_spec_decode.py tests/test_spec_draft_model.py tests/test_verify_runs.py \
    2>&1 | tee "$out/spec_tests.log" | tail -8
  replay='{"method":"replay","acceptance_rate":0.7,"num_speculative_tokens":4}'
  ngram='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
  for model in qwen3-0.6b qwen3-8b; do
    python bench.py --model $model --latency --json "$out/spec_off_$model.json" 2>&1 | grep -v Warn | tee "$out/spec_off_$model.log" | tail -1
    python bench.py --model $model --latency --speculative-config "$replay" --json "$out/spec_replay_$model.json" 2>&1 \
      | grep -v Warn | tee "$out/spec_replay_$model.log" | tail -3
  done
  python bench.py --model qwen3-8b --latency --speculative-config '{"model":"qwen3-0.6b","num_speculative_tokens":4}' \
    --json "$out/spec_draft_qwen3-8b.json" 2>&1 | grep -v Warn | tee "$out/spec_draft_qwen3-8b.log" | tail -3
  python bench.py --temperature 0 --json "$out/spec_off_256.json" 2>&1 | grep -v Warn | tee "$out/spec_off_256.log" | tail -1
  for spec in replay ngram; do
    python bench.py --temperature 0 --speculative-config "${!spec}" --json "$out/spec_${spec}_256.json" 2>&1 \
      | grep -v Warn | tee "$out/spec_${spec}_256.log" | tail -2
  done
fi
if [[ $stage == moe ]]; then
  python -m pytest -q ${PYTEST_ARGS:-} tests/test_fused_moe_kernels.py tests/test_gpu_moe.py 2>&1 | tee "$out/moe_tests.log" | tail -8
  python benchmarks/moe.py ${MOE_ARGS:-} 2>&1 | grep -v Warn | tee "$out/moe_layer.log"
  for run in "moe_default" "moe_latency --latency" "moe_latency_fp8 --latency --quantization fp8"; do
    set -- $run
    python bench.py --model qwen3-30b-a3b --json "$out/$1.json" "${@:2}" 2>&1 | grep -v Warn | tee "$out/$1.log" | tail -3
  done
fi
if [[ $stage == moe-parallel ]]; then
  python -m pytest -q tests/test_gpu_moe.py -k "tp2 or ep2" 2>&1 | tee "$out/moe_parallel_tests.log" | tail -5
  for run in "moe_tp1 --tp 1" "moe_tp2 --tp 2" "moe_ep2 --tp 2 --enable-expert-parallel"; do
    set -- $run
    python bench.py --model qwen3-30b-a3b --json "$out/$1.json" "${@:2}" 2>&1 | grep -v Warn | tee "$out/$1.log" | tail -3
  done
fi
if [[ $stage == structured ]]; then
  tok=${TOKENIZER:-qwen3-tokenizer}
  python -m pytest -q tests/test_structured_outputs.py 2>&1 | tee "$out/structured_tests.log" | tail -5
  python benchmarks/structured.py --tokenizer "$tok" 2>&1 | grep -v Warn | tee "$out/structured_host.log"
  for run in "all" "half --structured-fraction 0.5" "xgrammar --structured-backend xgrammar"; do
    set -- $run
    python bench.py --structured json --tokenizer "$tok" --json "$out/structured_$1.json" "${@:2}" 2>&1 | grep -v Warn \
      | tee "$out/structured_$1.log" | tail -3
  done
fi
