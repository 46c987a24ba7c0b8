#!/usr/bin/env bash
# flash-cce demo (run by scripts/demo.sh): two LoRA iterations of the offline
# SmolLM2-135M (the model that is fast here: float32 on a CPU; tied head) on
# paragraphs of CPython's LICENSE with the flash-cce loss, then the loss
# head measured in this run: the stock loss and flash-cce on the same real
# hidden states (time, peak memory, the loss each gives).
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
MODEL=${MODEL:-$(python -c "from mlx_lm_ext import models; print(models.build(models.fast_model(), progress=False))")}
(set -x; mlx_lm.lora --model "$MODEL" --train --data "$D" --loss flash-cce \
    --iters 2 --batch-size 4 --val-batches 1 --adapter-path "$D/adapters")
ls "$D/adapters"
python - "$MODEL" <<'PY'
import pathlib, sys, sysconfig, time
import mlx.core as mx, mlx.nn as nn, mlx_lm
from mlx_lm_flash_cce import linear_cross_entropy

N = 512
model, tok = mlx_lm.load(sys.argv[1])
text = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
ids = mx.array(tok.encode(text)[: N + 1])
hidden = mx.stop_gradient(model.model(ids[None, :N])[0])  # real final hidden states
targets = ids[1:]
head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear
mx.eval(hidden, targets)


def measure(loss):
    # The loss and its gradient for the hidden states (a frozen head, as in LoRA).
    step = mx.value_and_grad(loss)
    best, peak = float("inf"), 0
    for _ in range(2):
        mx.clear_cache()
        mx.reset_peak_memory()
        held = mx.get_active_memory()
        t0 = time.perf_counter()
        value, grad = step(hidden)
        mx.eval(value, grad)
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, mx.get_peak_memory() - held)
    return value.item(), best, peak / 2**20


stock = measure(lambda h: nn.losses.cross_entropy(head(h), targets).mean())
flash = measure(lambda h: linear_cross_entropy(h, head, targets))
print(f"\nflash-cce, measured now: loss + gradient over {N} tokens x {model.args.vocab_size} "
      "vocabulary, this model's hidden states of the LICENSE text (best of 2)")
for name, (loss, t, mib) in (("stock loss", stock), ("flash-cce", flash)):
    print(f"  {name:<10}  loss {loss:.5f}  {t * 1e3:8.1f} ms  peak {mib:7.1f} MiB")
print(f"  flash-cce: {stock[1] / flash[1]:.2f}x the stock loss's speed, "
      f"{stock[2] / max(flash[2], 1e-6):.0f}x less peak memory, "
      f"loss difference {abs(stock[0] - flash[0]):.1e}")
PY
