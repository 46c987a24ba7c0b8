#!/usr/bin/env bash
# ssd-cache demo (run by scripts/demo.sh): a restarted mlx_lm.server answers a
# long prompt with its prompt cache restored from disk, and says how much
# sooner its first token came than the first run's, measured in this run.
# Uses SSD_DEMO_MODEL, else MODEL, else the offline model that is fast here
# (float32 on a CPU: fast prefill with OpenBLAS).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f scripts/env.sh ] && source scripts/env.sh
M=${SSD_DEMO_MODEL:-${MODEL:-}}
python plugins/ssd-cache/demo.py ${M:+--model "$M"} "$@"
