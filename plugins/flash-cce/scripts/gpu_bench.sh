#!/bin/bash
# flash-cce's GPU checks on a CUDA machine: the heads benchmark and the parity tests.
# Usage (repo root): WHEELS=DIR OUT=DIR bash plugins/flash-cce/scripts/gpu_bench.sh [tests|bench|all]
set -u
what=${1:-all}
source "$(dirname "$0")/stage.sh"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" || exit 5
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
B="python3 benchmarks/bench_flash_cce.py --heads --repeats 2"
if [ "$what" = bench ] || [ "$what" = all ]; then
  $B --json $OUT/gpu-default.json 2>&1 | tee $OUT/gpu-bench.log
  for opts in '{"chunk_elements": 16777216, "token_chunk": 4096}' '{"chunk_elements": 67108864, "token_chunk": 8192}'; do
    echo "== flash $opts" | tee -a $OUT/gpu-bench.log
    $B --max-stock-bytes 0 --flash-opts "$opts" 2>&1 | tail -3 | tee -a $OUT/gpu-bench.log
    echo "== flash $opts, memory limit +256 MiB" | tee -a $OUT/gpu-bench.log
    $B --max-stock-bytes 0 --memory-limit-mib 256 --flash-opts "$opts" 2>&1 | tail -3 | tee -a $OUT/gpu-bench.log
  done
  echo "== quantized 4-bit head" | tee -a $OUT/gpu-bench.log
  $B --quantized --shapes 8192x151936x2048 2>&1 | tail -2 | tee -a $OUT/gpu-bench.log
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider plugins/flash-cce/tests/test_parity.py plugins/flash-cce/tests/test_qmm.py 2>&1 | tail -25 | tee $OUT/gpu-tests.log
fi
