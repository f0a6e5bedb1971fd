# Sourced by scripts/demo.sh and scripts/sft_demo.sh: the repository root as
# the working directory, the environment's tools, and `train_np2 LABEL ARGS...`.
# shellcheck shell=bash
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=.venv/bin/python
HOROVODRUN=.venv/bin/horovodrun
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# tfgpt's commands start TensorFlow quietly (tfgpt.quiet). horovodrun's own
# launcher imports TensorFlow without tfgpt: its start-up lines (absl's, CUDA's,
# which no environment variable reaches) are filtered from its output below.
TF_NOISE='^(WARNING: All log messages before absl::InitializeLog|[IWE]0000 .*(cudart_stub|cuda_platform|cpu_feature_guard)\.cc|To enable the following instructions)'

# train_np2 LABEL ARGS...: train_hvd.py ARGS under `horovodrun -np 2` on this
# host; rank 0 does all the logging, shown without horovodrun's "[0]<stdout>:"
# prefix. A failed run ends the script with its status.
train_np2() {
  local label=$1 status
  shift
  set +e
  "$HOROVODRUN" -np 2 --gloo -H localhost:2 "$PYTHON" train_hvd.py "$@" 2>&1 \
    | sed -u -E "/$TF_NOISE/d; s/^\[0\]<stdout>://"
  status=${PIPESTATUS[0]}
  set -e
  if [[ $status -ne 0 ]]; then
    echo "== [$label] training failed (exit $status)" >&2
    exit "$status"
  fi
}
