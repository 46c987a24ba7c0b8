#!/usr/bin/env bash
# Stock greedy decoding vs the n-gram drafter on an input-grounded prompt,
# real SmolLM2-135M-Instruct in float32 (OpenBLAS preloaded when present).
set -euo pipefail
BLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
[ -e "$BLAS" ] && export LD_PRELOAD="$BLAS"
MODEL=$(python -c "from mlx_lm_ext import models; print(models.build('smollm2-135m-f32'))")
CODE=$(python -c "import ast, sysconfig, pathlib
src = pathlib.Path(sysconfig.get_paths()['stdlib'], 'textwrap.py').read_text()
print(next(ast.get_source_segment(src, n) for n in ast.parse(src).body if getattr(n, 'name', '') == 'indent'))")
PROMPT="Here is a function from Python's standard library:

$CODE

Rewrite this function, renaming the parameter \`prefix\` to \`margin\`. Output the complete code only."
N=${N:-128}
echo "### stock mlx-lm"
mlx_lm.generate --model "$MODEL" --max-tokens "$N" --verbose True --prompt "$PROMPT" | tail -4
echo "### --plugin spec-decode --drafter ngram"
mlx_lm.generate --model "$MODEL" --max-tokens "$N" --verbose True --prompt "$PROMPT" \
    --plugin spec-decode --drafter ngram | tail -5
