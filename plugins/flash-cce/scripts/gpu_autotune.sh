#!/bin/bash
# Device run for the auto backend and the memory budget: the one-table
# benchmark (each path and auto's choice, ratios against stock in the same
# run), the whole LoRA step on a ~1B random-weight llama, the CUDA tests.
# MLX's CUDA wheels staged as in shared/docs/mlx-cuda.md (part a in /tmp/w,
# part b in .device-wheels/b). Writes logs to $OUT.
# Usage (repo root): bash plugins/flash-cce/scripts/gpu_autotune.sh [auto] [step] [tests]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/mlx ]; then
  ls /tmp/w/mlx_cuda_13.part.* >/dev/null 2>&1 || { echo "part a missing in /tmp/w: $(ls /tmp/w 2>&1)"; exit 3; }
  cat /tmp/w/mlx_cuda_13.part.* .device-wheels/b/mlx_cuda_13.part.* > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl \
    && rm /tmp/w/*.part.* && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl || exit 4
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/plugins/flash-cce PYTHONUNBUFFERED=1 MLX_LM_EXT_CACHE=/tmp/mlxext \
  MLX_LM_FLASH_CCE_CACHE=/tmp/cce-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
B=benchmarks/bench_flash_cce.py
for step in ${*:-auto step tests}; do
  echo "=== $step $(date +%T)"
  case $step in
    auto) timeout ${AUTO_TIMEOUT:-330} python3 $B --auto-table --repeats 3 --auto-budgets ${AUTO_BUDGETS:-default 2G} \
            --auto-paths "mlx 8192x16384 +1024" "mlx 2048x8192 +128" "cuda-gemm 8192x16384 +1024" \
            "cuda-gemm 2048x8192 +128" "cuda fused" --json "$OUT/auto.json" 2>&1 | tee "$OUT/auto.log" ;;
    step) timeout ${STEP_TIMEOUT:-240} python3 $B --step --step-model random-llama-1b --step-batch 4 --step-seq 2048 \
            --step-layers 16 --step-repeats 3 --step-losses ${STEP_LOSSES:-default flash-cce flash-cce@2G} \
            --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" ;;
    tests) timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
             ${TESTS:-plugins/flash-cce/tests/test_cuda_gemm.py} plugins/flash-cce/tests/test_autotune.py \
             plugins/flash-cce/tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
  esac
done
echo "=== done $(date +%T)"
