#!/usr/bin/env bash
# Everything the GPU must show, in one device call: kernel and engine tests, decode attention
# bandwidth, bench.py. Logs go to $OUT (or ./gpu_logs).
set -uo pipefail
out=${OUT:-gpu_logs}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
stage=${1:-all}
if [[ $stage == all || $stage == tests ]]; then
  python -m pytest -q ${PYTEST_ARGS:-} ${TESTS:-tests/test_attention_kernels.py tests/test_gpu_engine.py} 2>&1 | tee "$out/tests.log" | tail -15
fi
if [[ $stage == all || $stage == bench ]]; then
  python benchmarks/decode_attention.py 2>&1 | tee "$out/decode_attention.log"
  python bench.py --json "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | grep -v Warn | tail -${BENCH_TAIL:-5}
fi
