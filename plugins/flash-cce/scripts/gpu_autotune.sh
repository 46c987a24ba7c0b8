#!/bin/bash
# Device run for the auto backend and the memory budget: the one-table
# benchmark (each path and auto's choice, ratios against stock in the same
# run), the whole LoRA step on a ~1B random-weight llama, the CUDA tests.
# Usage (repo root): WHEELS=DIR OUT=DIR [CACHE=DIR] \
#   bash plugins/flash-cce/scripts/gpu_autotune.sh [auto] [step] [trial] [tests]
# AUTO_KINDS (bf16 q4) and AUTO_SHAPES (NxVxH ...) narrow the table.
set -u
source "$(dirname "$0")/stage.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
B=benchmarks/bench_flash_cce.py
for step in ${*:-auto step tests}; do
  echo "=== $step $(date +%T)"
  case $step in
    auto) timeout ${AUTO_TIMEOUT:-330} python3 $B --auto-table --compiled --repeats 3 --auto-budgets ${AUTO_BUDGETS:-default 2G} \
            --kinds ${AUTO_KINDS:-bf16 q4} ${AUTO_SHAPES:+--shapes $AUTO_SHAPES} \
            --auto-paths "mlx 8192x32768 +1024" "mlx 8192x16384 +1024" "mlx 2048x8192 +128" \
            "cuda-gemm 8192x32768 +1024" "cuda-gemm 2048x8192 +128" "cuda fused" \
            --json "$OUT/auto${AUTO_TAG:-}.json" 2>&1 | tee "$OUT/auto${AUTO_TAG:-}.log" ;;
    trial) # fresh MLX and flash-cce caches: the first process is a first run on this machine
           export MLX_PTX_CACHE_DIR=$(mktemp -d) MLX_LM_FLASH_CCE_CACHE=$(mktemp -d)
           # auto twice, then the backend auto chose forced: the difference of the
           # first calls is what auto adds to a run
           for head in "" --q4; do for backend in auto auto mlx; do  # a fresh process each
             echo "trial ${head:-bf16} $backend" | tee -a "$OUT/trial.log"
             timeout ${TRIAL_TIMEOUT:-150} python3 plugins/flash-cce/scripts/trial_cost.py --shape 8192x151936x2048 \
               $head --backend $backend 2>&1 | tee -a "$OUT/trial.log"; done; done ;;
    step) timeout ${STEP_TIMEOUT:-240} python3 $B --step --step-model random-llama-1b --step-batch 4 --step-seq 2048 \
            --step-layers 16 --step-repeats 3 --step-losses ${STEP_LOSSES:-default flash-cce flash-cce@2G} \
            --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" ;;
    tests) timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rs --durations=8 \
             ${TESTS:-plugins/flash-cce/tests/test_cuda_gemm.py} plugins/flash-cce/tests/test_autotune.py \
             plugins/flash-cce/tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
  esac
done
echo "=== done $(date +%T)"
