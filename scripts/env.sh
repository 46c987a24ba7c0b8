# Sourced by the demo and test scripts: the venv, and OpenBLAS for MLX's CPU backend.
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ -e "$OPENBLAS" ]; then export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"; fi
export PATH="$PWD/.venv/bin:$PATH"
export TOKENIZERS_PARALLELISM=false
