#!/usr/bin/env bash
# The main job on the built-in corpus: prepare the data, train the demo GPT
# with `horovodrun -np 2` on CPU, show the loss falling, print a sample.
# Environment overrides: DEMO_STEPS (default 300), DEMO_DATA, DEMO_OUT.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=.venv/bin/python
HOROVODRUN=.venv/bin/horovodrun
DATA="${DEMO_DATA:-data/demo}"
OUT="${DEMO_OUT:-runs/demo}"
STEPS="${DEMO_STEPS:-300}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# TensorFlow's start-up chatter (absl lines that TF_CPP_MIN_LOG_LEVEL does not
# reach); every other line, errors included, passes through.
TF_NOISE='(I0000|W0000|E0000|absl::InitializeLog|cuda|oneDNN|rebuild TensorFlow|To enable the following)'

start=$SECONDS
if [[ -f "$DATA/manifest.json" ]]; then
  echo "== [demo] reusing prepared data in $DATA"
else
  echo "== [demo] preparing the built-in corpus (pydoc topics + standard-library docstrings) into $DATA"
  rm -rf "$DATA"
  "$PYTHON" -m pipelines.prepare --output "$DATA" --seq-len 128 --vocab-size 2000 --shard-size 4M \
    2> >(sed -u -E "/$TF_NOISE/d" >&2)
fi

echo "== [demo] training gpt-demo for $STEPS steps with horovodrun -np 2 (CPU)"
rm -rf "$OUT"
# Rank 0 does all the logging; the filter also drops horovodrun's
# "[0]<stdout>:" prefix.
set +e
"$HOROVODRUN" -np 2 --gloo -H localhost:2 "$PYTHON" train_hvd.py \
  --data "$DATA" --preset gpt-demo --steps "$STEPS" --batch-size 16 \
  --learning-rate 1e-3 --warmup-steps 40 --log-every 20 --out "$OUT" 2>&1 \
  | sed -u -E "/$TF_NOISE/d; s/^\[0\]<stdout>://"
status=${PIPESTATUS[0]}
set -e
if [[ $status -ne 0 ]]; then
  echo "== [demo] training failed (exit $status)" >&2
  exit "$status"
fi

echo "== [demo] sample from the trained model"
"$PYTHON" -m tfgpt.generate --checkpoint "$OUT" --prompt "The built-in function" \
  --max-new-tokens 60 --temperature 0.8 --top-k 40 --seed 1 2> >(sed -u -E "/$TF_NOISE/d" >&2)
echo "== [demo] done in $((SECONDS - start))s; run directory: $OUT (tensorboard --logdir $OUT)"
