#!/usr/bin/env bash
# spec-decode demo (run by scripts/demo.sh): stock greedy decoding, then the
# n-gram drafter, on an input-grounded prompt (rename a parameter in a
# function from Python's standard library), with the offline model that is
# fast on this machine (float32 on a CPU, with OpenBLAS when present). Both
# answers are printed in full, compared token for token (the same text is
# the promise), and the speeds each run measured are set side by side.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f scripts/env.sh ] && source scripts/env.sh
MODEL=${MODEL:-$(python -c "from mlx_lm_ext import models; print(models.build(models.fast_model(), progress=False))")}
CODE=$(python -c "import ast, sysconfig, pathlib
src = pathlib.Path(sysconfig.get_paths()['stdlib'], 'textwrap.py').read_text()
print(next(ast.get_source_segment(src, n) for n in ast.parse(src).body if getattr(n, 'name', '') == 'indent'))")
PROMPT="Here is a function from Python's standard library:

$CODE

Rewrite this function, renaming the parameter \`prefix\` to \`margin\`. Output the complete code only."
N=${N:-128}
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
run() { mlx_lm.generate --model "$MODEL" --max-tokens "$N" --verbose True --prompt "$PROMPT" "$@"; }
echo "### stock mlx-lm"
run | tee "$D/stock.txt"
echo "### --plugin spec-decode --drafter ngram"
run --plugin spec-decode --drafter ngram | tee "$D/spec.txt"
echo "### measured in this run"
python - "$D/stock.txt" "$D/spec.txt" <<'PY'
import re, sys

def parse(path):
    out = open(path).read()
    text = out.split("=" * 10)[1]  # what mlx-lm printed between its two rules
    tps = float(re.search(r"Generation: \d+ tokens, ([\d.]+) tokens-per-sec", out).group(1))
    return out, text, tps

_, stock_text, stock_tps = parse(sys.argv[1])
out, spec_text, spec_tps = parse(sys.argv[2])
tpf = re.search(r"([\d.]+) tokens per target forward \((\d+) tokens, (\d+) forwards\)", out)
same = "identical" if spec_text == stock_text else "DIFFERENT (a bug: please report it)"
print(f"text: {same} ({len(stock_text)} characters each)" if spec_text == stock_text else f"text: {same}")
print(f"generation: stock {stock_tps:.2f} tokens/s, spec-decode {spec_tps:.2f} tokens/s: {spec_tps / stock_tps:.2f}x")
if tpf:
    print(f"target forwards: {tpf.group(3)} for {tpf.group(2)} tokens ({tpf.group(1)} tokens per forward; stock: 1.00)")
PY
