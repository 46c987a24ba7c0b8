#!/bin/bash
# Device run for the fused CUDA kernels: smoke check, tests, benchmark table.
# Usage (repo root): WHEELS=DIR OUT=DIR [CACHE=DIR] \
#   bash plugins/flash-cce/scripts/gpu_cuda.sh [smoke] [tests] [bench]
set -u
source "$(dirname "$0")/stage.sh"
steps=${*:-smoke tests bench}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    smoke) timeout 150 python3 plugins/flash-cce/scripts/cuda_smoke.py 2>&1 | tee $OUT/smoke.log ;;
    sweep) timeout 60 python3 plugins/flash-cce/scripts/cuda_smoke.py --sweep 2>&1 | tee $OUT/sweep.log ;;
    tests) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider -rs --durations=5 --timeout=100 --timeout-method=thread plugins/flash-cce/tests/test_cuda.py \
             2>&1 | tee $OUT/tests.log | tail -40 ;;
    parity) timeout ${PARITY_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider plugins/flash-cce/tests/test_parity.py \
             plugins/flash-cce/tests/test_plugin.py -k "bfloat16 or doctor" 2>&1 | tee $OUT/parity.log | tail -15 ;;
    bench) timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_flash_cce.py --gpu-table --repeats 3 \
             --max-stock-bytes 1e11 --json $OUT/gpu-table.json ${BENCH_ARGS:-} 2>&1 | tee $OUT/bench.log ;;
  esac
done
echo "=== done $(date +%T)"
