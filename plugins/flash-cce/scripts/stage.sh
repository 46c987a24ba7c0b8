#!/bin/bash
# Sourced by the flash-cce GPU scripts on a machine without network: the
# repository's one staging step, scripts/gpu-env.sh (MLX's CUDA wheels and
# the offline model from the folder scripts/gpu-stage.sh staged, the plugins
# registered, this tree on PYTHONPATH; see "MLX on NVIDIA GPUs" in
# docs/gpu.md).
#
#   WHEELS  the staged folder; required
#   OUT     folder for logs and JSON; required
#   CACHE   folder for the offline models and auto's cached choices; optional
usage="usage: WHEELS=DIR OUT=DIR [CACHE=DIR] bash $0 [steps]"
[ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ] || { echo "WHEELS: not a folder. $usage" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "OUT: not set. $usage" >&2; exit 2; }
mkdir -p "$OUT"
if [ -n "${CACHE:-}" ]; then
  export MLX_LM_EXT_CACHE="$CACHE/models" MLX_LM_FLASH_CCE_CACHE="$CACHE/flash-cce"
fi
source scripts/gpu-env.sh "$WHEELS" || exit $?
