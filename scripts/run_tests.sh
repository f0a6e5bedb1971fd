#!/usr/bin/env bash
# Run the test suite with the repo's venv. Extra arguments go to pytest,
# e.g. scripts/run_tests.sh -m "not distributed" -x
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
PY="$REPO_ROOT/.venv/bin/python"
[[ -x "$PY" ]] || { echo "[run_tests] ERROR: $PY not found: run 'make setup' first" >&2; exit 1; }

# Hide TF's C++ INFO lines (oneDNN notices, CPU feature banners); warnings stay.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

# Two pytest workers (pytest-xdist): much of a test's time is one process
# importing TensorFlow or tracing, one core's work, so a second test fits beside
# it (bench/RESULTS.md, "Test suite"). --dist loadgroup gives the slow
# multi-process tests, one xdist group (tests/conftest.py), to one worker, one
# after another; the other tests go out one or two at a time in their order.
# TFGPT_TEST_WORKERS=0 runs the suite in this one process (for -x or --pdb).
WORKERS="${TFGPT_TEST_WORKERS:-2}"
xdist=()
if [[ "$WORKERS" != "0" ]]; then xdist=(-n "$WORKERS" --dist loadgroup); fi

rc=0
"$PY" -m pytest tests -v -rs --durations=15 "${xdist[@]}" "$@" || rc=$?
if [[ "$rc" == "5" ]]; then
  # A run that tested nothing must not look green.
  echo "[run_tests] ERROR: pytest collected no tests (exit code 5); failing the run" >&2
  exit 1
fi
exit "$rc"
