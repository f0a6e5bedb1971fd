#!/usr/bin/env bash
# The main job on the built-in corpus: prepare the data, train the demo GPT
# with `horovodrun -np 2` on CPU, show the loss falling, print a sample.
# Environment overrides: DEMO_STEPS (default 300), DEMO_DATA, DEMO_OUT.
set -euo pipefail

# shellcheck source=scripts/demo_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/demo_common.sh"
DATA="${DEMO_DATA:-data/demo}"
OUT="${DEMO_OUT:-runs/demo}"
STEPS="${DEMO_STEPS:-300}"

start=$SECONDS
if [[ -f "$DATA/manifest.json" ]]; then
  echo "== [demo] reusing prepared data in $DATA"
else
  echo "== [demo] preparing the built-in corpus (pydoc topics + standard-library docstrings) into $DATA"
  rm -rf "$DATA"
  "$PYTHON" -m pipelines.prepare --output "$DATA" --seq-len 128 --vocab-size 2000 --shard-size 4M
fi

echo "== [demo] training gpt-demo for $STEPS steps with horovodrun -np 2 (CPU)"
rm -rf "$OUT"
train_np2 demo --data "$DATA" --preset gpt-demo --steps "$STEPS" --batch-size 16 \
  --learning-rate 1e-3 --warmup-steps 40 --log-every 20 --out "$OUT"

echo "== [demo] sample from the trained model"
"$PYTHON" -m tfgpt.generate --checkpoint "$OUT" --prompt "The built-in function" \
  --max-new-tokens 60 --temperature 0.8 --top-k 40 --seed 1
echo "== [demo] done in $((SECONDS - start))s; run directory: $OUT (tensorboard --logdir $OUT)"
