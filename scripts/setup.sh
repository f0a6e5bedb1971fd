#!/usr/bin/env bash
# Create .venv/ at the repo root with Python 3.11, install the pinned stack
# (requirements.txt, requirements-test.txt, requirements-docs.txt, tfgpt itself
# in editable mode) and build Horovod against it (scripts/build_horovod.sh),
# then tfgpt's fused CPU kernels (python -m tfgpt.kernels.build).
#
# Safe to rerun: the pip step is skipped while a stamp in .venv records the
# sha256 of the requirement files it installed, and the Horovod build is
# skipped while its stamp matches the installed TensorFlow and hvd.init() works.
# TFGPT_PYTHON=/path/to/python3.11 overrides the interpreter used for the venv.
# The Docker images (docker/) run this same script with two more settings:
#   TFGPT_VENV=/opt/venv            where the venv lives (default: .venv at the repo root)
#   TFGPT_REQUIREMENTS="requirements.txt ..."
#                                   the requirement files to install, relative to the
#                                   repo root (default: requirements.txt requirements-test.txt
#                                   requirements-docs.txt)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
VENV="${TFGPT_VENV:-$REPO_ROOT/.venv}"
PY="$VENV/bin/python"
REQ_STAMP="$VENV/.tfgpt-requirements.sha256"

log() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }
start=$SECONDS
# Each step's time, said when it ends and listed again at the end.
step_start=$SECONDS
TIMES=()
step_done() {
  local took=$((SECONDS - step_start))
  TIMES+=("$1 ${took}s")
  log "step '$1' took ${took}s"
  step_start=$SECONDS
}

read -r -a REQ_FILES <<< "${TFGPT_REQUIREMENTS:-requirements.txt requirements-test.txt requirements-docs.txt}"
((${#REQ_FILES[@]})) || die "TFGPT_REQUIREMENTS names no requirement file. Received: TFGPT_REQUIREMENTS='${TFGPT_REQUIREMENTS:-}'"
for req_file in "${REQ_FILES[@]}"; do
  [[ -f "$req_file" ]] \
    || die "requirement file '$req_file' not found in $REPO_ROOT. Received: TFGPT_REQUIREMENTS='${TFGPT_REQUIREMENTS:-}'"
done

# --- 1. A Python 3.11 to create the venv with -------------------------------
is_py311() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1; }
find_python() {
  local candidate
  for candidate in "${TFGPT_PYTHON:-}" python3.11 python3; do
    [[ -n "$candidate" ]] || continue
    if command -v "$candidate" >/dev/null 2>&1 && is_py311 "$candidate"; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

if [[ -x "$PY" ]] && ! is_py311 "$PY"; then
  log "existing $VENV does not run Python 3.11 (moved or broken): recreating it"
  rm -rf "$VENV"
fi
if [[ ! -x "$PY" ]]; then
  BASE_PY="$(find_python)" \
    || die "Python 3.11 not found (python3.11, or python3 = $(python3 --version 2>&1 || echo none)): install it with apt-get install python3.11 python3.11-venv python3.11-dev"
  "$BASE_PY" -c 'import ensurepip, venv' >/dev/null 2>&1 \
    || die "Python venv/ensurepip module missing for $BASE_PY: apt-get install python3.11-venv"
else
  BASE_PY="$PY"
fi

# --- 2. System tools for the Horovod build, checked before anything long ----
PYTHON="$BASE_PY" "$REPO_ROOT/scripts/build_horovod.sh" --check-prereqs

step_done "checks"

# --- 3. The venv ---------------------------------------------------------------
if [[ ! -x "$PY" ]]; then
  log "creating $VENV with $BASE_PY ($("$BASE_PY" --version 2>&1))"
  "$BASE_PY" -m venv "$VENV" || die "step 'python -m venv $VENV' failed: apt-get install python3.11-venv"
fi
# A venv whose creation was interrupted has a python but no pip.
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  log "pip missing in $VENV: bootstrapping it with ensurepip"
  "$PY" -m ensurepip --upgrade >/dev/null || die "step 'python -m ensurepip' failed: apt-get install python3.11-venv"
fi

step_done "venv"

# --- 4. Python packages ----------------------------------------------------------
# setup.py and the list of top-level packages are in the stamp too: the
# editable install maps only the packages that existed when it ran.
req_digest() {
  {
    "$PY" --version 2>&1
    sha256sum "${REQ_FILES[@]}"
    if [[ -f setup.py ]]; then sha256sum setup.py; fi
    compgen -G '*/__init__.py' | sort || true
  } | sha256sum | cut -d' ' -f1
}
want_digest="$(req_digest)"
if [[ -f "$REQ_STAMP" && "$(cat "$REQ_STAMP")" == "$want_digest" ]]; then
  log "requirements unchanged since the last install: skipping pip"
else
  rm -f "$REQ_STAMP"
  log "upgrading pip, setuptools, wheel (Horovod builds with --no-build-isolation and needs them) and uv"
  "$PY" -m pip install --quiet --upgrade pip setuptools wheel \
    || die "step 'pip install --upgrade pip setuptools wheel' failed (see pip output above)"
  # uv installs what pip would, in seconds from its cache (scripts/pip_install.sh);
  # without it, pip does the same work more slowly.
  if [[ "${TFGPT_INSTALLER:-uv}" == "uv" ]] \
      && ! "$PY" -m pip install --quiet "uv>=0.13,<0.14"; then
    log "uv could not be installed: installing with pip (slower; TFGPT_INSTALLER=pip says so)"
  fi
  log "installing ${REQ_FILES[*]} (TensorFlow is large: a few minutes on a fresh venv with pip)"
  req_args=()
  for req_file in "${REQ_FILES[@]}"; do req_args+=(-r "$req_file"); done
  # Show what is fetched and installed, not pip's wall of already-satisfied lines.
  if ! PYTHON="$PY" "$REPO_ROOT/scripts/pip_install.sh" "${req_args[@]}" 2>&1 \
      | { grep -v '^Requirement already satisfied' || true; }; then
    die "step 'pip install ${req_args[*]}' failed (see the output above)"
  fi
  if [[ -f setup.py ]]; then
    log "installing tfgpt in editable mode"
    PYTHON="$PY" "$REPO_ROOT/scripts/pip_install.sh" --quiet --no-deps -e . \
      || die "step 'pip install -e . --no-deps' failed (see the output above)"
  fi
  echo "$want_digest" > "$REQ_STAMP"
  log "python packages installed"
fi

step_done "python packages"

# --- 5. Horovod -----------------------------------------------------------------
PYTHON="$PY" "$REPO_ROOT/scripts/build_horovod.sh"
step_done "horovod"

# --- 6. tfgpt's fused CPU kernels (tfgpt/kernels/cc) ----------------------------
# Compiled against the installed TensorFlow; skipped while their stamp matches
# (and in the Docker images' first, dependencies-only layer, which has no sources).
if [[ -d tfgpt/kernels/cc ]]; then
  TF_CPP_MIN_LOG_LEVEL=2 "$PY" -m tfgpt.kernels.build \
    || die "step 'python -m tfgpt.kernels.build' failed (compiler output above); tfgpt still runs without them (TFGPT_FUSED_KERNELS=0 silences the warning), only slower"
fi

step_done "kernels"

summary="$(printf '%s, ' "${TIMES[@]}")"
log "done in $((SECONDS - start))s (${summary%, }): use $PY (or 'make test')"
