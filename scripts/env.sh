# Sourced by the demo and test scripts: the venv, and OpenBLAS for MLX's CPU backend.
# Works from any folder: the venv is found next to this script's folder.
_MLX_LM_EXT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ -e "$OPENBLAS" ]; then export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"; fi
export PATH="$_MLX_LM_EXT_ROOT/.venv/bin:$PATH"
export TOKENIZERS_PARALLELISM=false
unset _MLX_LM_EXT_ROOT
