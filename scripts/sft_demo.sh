#!/usr/bin/env bash
# Fine-tuning the demo GPT on instructions, end to end on the built-in corpus:
# each document a conversation (its first sentence the user's turn, the rest
# the reply, in ChatML's turns), prepared with the demo run's tokenizer; the
# validation loss on the replies before and after `--task sft` with
# `horovodrun -np 2`; a reply from `tfgpt.generate --chat`.
# Needs the demo run (scripts/demo.sh; run first when missing).
# Environment overrides: SFT_STEPS (default 200), DEMO_DATA, DEMO_OUT, SFT_DATA, SFT_OUT.
set -euo pipefail

# shellcheck source=scripts/demo_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/demo_common.sh"
PRETRAINED="${DEMO_OUT:-runs/demo}"
DATA="${SFT_DATA:-data/demo-chat}"
OUT="${SFT_OUT:-runs/demo-chat}"
STEPS="${SFT_STEPS:-200}"

start=$SECONDS
if [[ ! -f "$PRETRAINED/config.json" ]]; then
  echo "== [sft] no pretrained run in $PRETRAINED: running scripts/demo.sh first"
  DEMO_OUT="$PRETRAINED" bash scripts/demo.sh
fi
echo "== [sft] the built-in corpus as conversations, with $PRETRAINED's tokenizer, into $DATA"
rm -rf "$DATA"
"$PYTHON" -m pipelines.prepare --format instructions --tokenizer "$PRETRAINED" \
  --output "$DATA" --seq-len 128 --too-long truncate --shard-size 4M

sft() {  # OUT STEPS LEARNING_RATE: one --task sft run
  train_np2 sft --task sft --init "$PRETRAINED" --data "$DATA" --out "$1" --steps "$2" \
    --batch-size 16 --learning-rate "$3" --warmup-steps 20 --log-every 20 --eval-batches 20
}
echo "== [sft] the pretrained model's loss on the replies (one step at learning rate 1e-30)"
rm -rf "$OUT-before"
sft "$OUT-before" 1 1e-30
echo "== [sft] fine-tuning for $STEPS steps with horovodrun -np 2 (CPU)"
rm -rf "$OUT"
sft "$OUT" "$STEPS" 1e-3
"$PYTHON" - "$OUT-before" "$OUT" <<'PY'
import json, sys
def val_loss(run):
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    return [row["loss"] for row in rows if row["split"] == "val"][-1]
before, after = map(val_loss, sys.argv[1:])
print(f"== [sft] validation loss on the replies: {before:.3f} pretrained, {after:.3f} fine-tuned")
PY
echo "== [sft] a reply from the fine-tuned model (tfgpt.generate --chat)"
"$PYTHON" -m tfgpt.generate --checkpoint "$OUT" --chat \
  --prompt "Return the number of items in a container." --max-new-tokens 60 \
  --temperature 0.8 --top-k 40 --seed 1
echo "== [sft] done in $((SECONDS - start))s; run directory: $OUT"
