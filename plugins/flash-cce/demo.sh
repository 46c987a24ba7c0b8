#!/usr/bin/env bash
# flash-cce demo (run by scripts/demo.sh): two LoRA iterations of the offline
# SmolLM2-135M (4-bit, tied head) on paragraphs of CPython's LICENSE, with the
# flash-cce loss; it prints what the loss head no longer holds in memory.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f scripts/env.sh ] && source scripts/env.sh
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
python - "$D" <<'PY'
import json, sys, sysconfig, pathlib
text = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
paras = [" ".join(p.split())[:400] for p in text.split("\n\n") if len(p.split()) > 20]
for name, part in (("train", paras[:16]), ("valid", paras[16:24])):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        f.writelines(json.dumps({"text": p}) + "\n" for p in part)
PY
MODEL=$(python -c "from mlx_lm_ext import models; print(models.build('smollm2-135m'))")
set -x
mlx_lm.lora --model "$MODEL" --train --data "$D" --loss flash-cce \
    --iters 2 --batch-size 4 --val-batches 1 --adapter-path "$D/adapters"
ls "$D/adapters"
