#!/bin/bash
# Sourced by the flash-cce GPU scripts: MLX's CUDA build on PYTHONPATH on a
# machine without network (see "MLX on NVIDIA GPUs" in docs/architecture.md).
#
#   SITE    folder with MLX's CUDA wheels unpacked (pip install --no-index
#           --no-deps --target SITE ...); required
#   OUT     folder for logs and JSON; required
#   WHEELS  folders holding the wheel files, or the two halves of the
#           mlx-cuda wheel (mlx_cuda_13.part.*), installed into SITE when it
#           has no mlx yet; optional
#   CACHE   folder for the offline models and auto's cached choices; optional
usage="usage: SITE=DIR OUT=DIR [WHEELS=\"DIR ...\"] [CACHE=DIR] bash $0 [steps]"
[ -n "${SITE:-}" ] || { echo "SITE: not set. $usage" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "OUT: not set. $usage" >&2; exit 2; }
mkdir -p "$SITE" "$OUT"
if [ ! -d "$SITE/mlx" ]; then
  [ -n "${WHEELS:-}" ] || { echo "SITE has no mlx and WHEELS is not set. $usage" >&2; exit 2; }
  tmp=$(mktemp -d)
  for d in $WHEELS; do cp "$d"/* "$tmp"/; done
  if ls "$tmp"/mlx_cuda_13.part.* >/dev/null 2>&1; then  # the wheel keeps its own name
    cat "$tmp"/mlx_cuda_13.part.* > "$tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"
    rm -f "$tmp"/mlx_cuda_13.part.* "$tmp"/*.md5
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$tmp"/*.whl || exit 4
  rm -rf "$tmp"
fi
export PYTHONPATH="$SITE:$PWD:$PWD/plugins/flash-cce" PYTHONUNBUFFERED=1
if [ -n "${CACHE:-}" ]; then
  export MLX_LM_EXT_CACHE="$CACHE/models" MLX_LM_FLASH_CCE_CACHE="$CACHE/flash-cce"
fi
