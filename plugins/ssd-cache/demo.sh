#!/usr/bin/env bash
# ssd-cache demo (run by scripts/demo.sh): a restarted mlx_lm.server answers a
# long prompt with its prompt cache restored from disk. Uses the float32
# SmolLM2 (fast prefill with OpenBLAS) unless SSD_DEMO_MODEL is set.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f scripts/env.sh ] && source scripts/env.sh
python plugins/ssd-cache/demo.py ${SSD_DEMO_MODEL:+--model "$SSD_DEMO_MODEL"} "$@"
