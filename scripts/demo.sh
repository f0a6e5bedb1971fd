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
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# tfgpt's commands start TensorFlow quietly (tfgpt.quiet). horovodrun's own
# launcher imports TensorFlow without tfgpt: its start-up lines (absl's, CUDA's,
# which no environment variable reaches) are filtered from its output below.
TF_NOISE='^(WARNING: All log messages before absl::InitializeLog|[IWE]0000 .*(cudart_stub|cuda_platform|cpu_feature_guard)\.cc|To enable the following instructions)'

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
# Rank 0 does all the logging; sed also drops horovodrun's "[0]<stdout>:" prefix.
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
  --max-new-tokens 60 --temperature 0.8 --top-k 40 --seed 1
echo "== [demo] done in $((SECONDS - start))s; run directory: $OUT (tensorboard --logdir $OUT)"
