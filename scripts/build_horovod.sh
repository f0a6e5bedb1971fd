#!/usr/bin/env bash
# Build Horovod from its sdist against the TensorFlow installed in the venv.
#
# Usage: scripts/build_horovod.sh [--force | --check-prereqs]
#   (no flag)        build unless the stamp says this exact build is done and
#                    `import horovod.tensorflow; hvd.init()` works
#   --force          rebuild even if the stamp is current (and the wheel cached)
#   --check-prereqs  only check the system tools the build needs, then exit
# PYTHON selects the interpreter (default: .venv/bin/python at the repo root).
# The build is a wheel kept in TFGPT_CACHE_DIR (default ~/.cache/tfgpt)/horovod/
# under a digest of what it was built from (Horovod, TensorFlow, Python, the
# compiler, the machine, this recipe and its patches, the GPU operations): a
# second clone or venv on the machine installs it in seconds instead of
# building again. Delete the folder to build anew.
# HOROVOD_GPU_OPERATIONS=NCCL builds the GPU allreduce with NCCL as well (the GPU
# image, docker/Dockerfile.gpu); it needs nvcc and nccl.h. The CUDA and NCCL
# location variables of Horovod's CMake (HOROVOD_CUDA_HOME, HOROVOD_NCCL_HOME,
# HOROVOD_NCCL_INCLUDE, HOROVOD_NCCL_LIB, HOROVOD_NCCL_LINK) and
# HOROVOD_BUILD_CUDA_CC_LIST pass through from the environment. Unset, the
# build is the CPU one described below.
#
# Why build from source: there is no Horovod wheel for TF 2.21 / Python 3.11,
# and the 0.28.1 sdist (the newest release) does not compile against TF >= 2.16
# because horovod/tensorflow/xla_mpi_ops.cc includes pre-2.16 XLA header paths.
# That file only provides Horovod ops for XLA-compiled graphs (off unless
# HOROVOD_ENABLE_XLA_OPS=1), so we drop it from the TF source list and build
# CPU-only with Gloo and without MPI: gcc, make and the cmake from
# requirements.txt are all it needs.
set -euo pipefail

readonly HOROVOD_VERSION="0.28.1"
readonly HOROVOD_SDIST_SHA256="92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
# Bump when the build recipe (patch, env vars) changes so old stamps go stale.
readonly BUILD_RECIPE="3"
readonly XLA_LINE='list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")'
readonly MPI_OPS_LINE='list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/mpi_ops.cc")'
readonly STREAM_DECL_LINE='GpuStreamHandle AsGpuStreamValue(Stream* stream);'
readonly STREAM_INCLUDE_LINE='#include "tensorflow/compiler/xla/stream_executor/stream.h"'

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
BUILD_DIR="$REPO_ROOT/build"
LOG="$BUILD_DIR/horovod-build.log"

log() { echo "[build_horovod] $*"; }
die() { echo "[build_horovod] ERROR: $*" >&2; exit 1; }

MODE="build"
case "${1:-}" in
  "") ;;
  --force) MODE="force" ;;
  --check-prereqs) MODE="check" ;;
  *) die "unknown argument '$1' (expected --force or --check-prereqs)" ;;
esac

GPU_OPERATIONS="${HOROVOD_GPU_OPERATIONS:-}"
case "$GPU_OPERATIONS" in
  "" | NCCL) ;;
  *) die "HOROVOD_GPU_OPERATIONS must be unset (CPU build) or NCCL (this build has Gloo and no MPI). Received: HOROVOD_GPU_OPERATIONS=$GPU_OPERATIONS" ;;
esac

# Where Horovod's build looks for nvcc (cmake/build_utils.py) and nccl.h
# (cmake/Modules/FindNCCL.cmake), so a missing one fails here, not minutes in.
find_nvcc() {
  local candidate
  for candidate in "$(command -v nvcc || true)" "${HOROVOD_CUDA_HOME:-/usr/local/cuda}/bin/nvcc"; do
    [[ -n "$candidate" && -x "$candidate" ]] && { echo "$candidate"; return 0; }
  done
  return 1
}
find_nccl_header() {
  local dir
  for dir in "${HOROVOD_NCCL_INCLUDE:-}" "${HOROVOD_NCCL_HOME:+$HOROVOD_NCCL_HOME/include}" \
      /usr/include /usr/local/include "${HOROVOD_CUDA_HOME:-/usr/local/cuda}/include"; do
    [[ -n "$dir" && -f "$dir/nccl.h" ]] && { echo "$dir/nccl.h"; return 0; }
  done
  return 1
}

check_prereqs() {
  [[ -x "$PYTHON" ]] || die "python not found at $PYTHON: run scripts/setup.sh first (or set PYTHON=...)"
  local tool
  for tool in gcc g++ make; do
    command -v "$tool" >/dev/null 2>&1 \
      || die "$tool not found: install it with apt-get install $tool"
  done
  local include_dir
  include_dir="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  [[ -f "$include_dir/Python.h" ]] \
    || die "Python.h missing in $include_dir: apt-get install python3-dev (python3.11-dev)"
  if [[ "$GPU_OPERATIONS" == "NCCL" ]]; then
    find_nvcc >/dev/null \
      || die "HOROVOD_GPU_OPERATIONS=NCCL needs nvcc: not on PATH nor in ${HOROVOD_CUDA_HOME:-/usr/local/cuda}/bin (use an nvidia/cuda *-devel image or set HOROVOD_CUDA_HOME)"
    find_nccl_header >/dev/null \
      || die "HOROVOD_GPU_OPERATIONS=NCCL needs nccl.h: apt-get install libnccl-dev, or set HOROVOD_NCCL_HOME / HOROVOD_NCCL_INCLUDE"
  fi
}

check_prereqs
if [[ "$MODE" == "check" ]]; then
  log "prerequisites OK (gcc, g++, make, Python.h${GPU_OPERATIONS:+, $(find_nvcc), $(find_nccl_header)})"
  exit 0
fi

VENV_DIR="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
STAMP="$VENV_DIR/.tfgpt-horovod.stamp"

# Keep TF's C++ INFO banners out of the checks below.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# Read the version from the package metadata: importing TF costs seconds.
TF_VERSION="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("tensorflow"))' 2>/dev/null)" \
  || die "tensorflow is not installed for $PYTHON: install requirements.txt first (scripts/setup.sh)"
# A CPU build's stamp reads as it always has; a GPU build's names its operations,
# so switching between the two rebuilds.
EXPECTED_STAMP="horovod=$HOROVOD_VERSION tensorflow=$TF_VERSION recipe=$BUILD_RECIPE${GPU_OPERATIONS:+ gpu_operations=$GPU_OPERATIONS}"

# Same test the stamp check and the post-build check use. hvd.init() outside
# horovodrun starts a size-1 Gloo context; it proves the TF op library loads.
hvd_works() {
  "$PYTHON" -c 'import horovod.tensorflow as hvd; hvd.init(); assert hvd.size() >= 1' >/dev/null 2>&1
}

if [[ "$MODE" == "build" && -f "$STAMP" && "$(cat "$STAMP")" == "$EXPECTED_STAMP" ]]; then
  if hvd_works; then
    log "horovod $HOROVOD_VERSION already built against tensorflow $TF_VERSION: skipping build"
    exit 0
  fi
  log "stamp is current but 'import horovod.tensorflow; hvd.init()' fails: rebuilding"
fi

# The wheel cache: one folder per digest of what the build depends on.
CACHE_ROOT="${TFGPT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tfgpt}/horovod"
WHEEL_KEY="$({
  echo "$EXPECTED_STAMP"
  "$PYTHON" -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())'
  "${CXX:-g++}" --version 2>&1 | head -1
  uname -m
  env | grep -E '^(CXXFLAGS|CFLAGS|LDFLAGS|HOROVOD_[A-Z_]*(CUDA|NCCL)[A-Z_]*)=' | sort || true
  sha256sum "$REPO_ROOT"/scripts/{build_horovod.sh,patch_horovod_checks.py,patch_horovod_elastic.py} \
    | cut -d' ' -f1
} | sha256sum | cut -c1-16)"
WHEEL_DIR="$CACHE_ROOT/$WHEEL_KEY"

install_cached_wheel() {
  local wheel
  wheel="$(compgen -G "$WHEEL_DIR/horovod-$HOROVOD_VERSION-*.whl" | head -1 || true)"
  [[ -n "$wheel" ]] || return 1
  log "installing the wheel built earlier on this machine: $wheel"
  rm -f "$STAMP"
  if "$PYTHON" -m pip show horovod >/dev/null 2>&1; then
    "$PYTHON" -m pip uninstall --yes --quiet horovod || return 1
  fi
  # With its dependencies (cloudpickle, psutil, ...), as the build installs it.
  PYTHON="$PYTHON" "$REPO_ROOT/scripts/pip_install.sh" --quiet "$wheel" || return 1
  hvd_works || { log "the cached wheel does not load here: building anew"; return 1; }
}

if [[ "$MODE" == "build" ]] && install_cached_wheel; then
  HOROVODRUN="$(dirname "$PYTHON")/horovodrun"
  "$HOROVODRUN" --check-build >/dev/null 2>&1 || true  # fills the patched build checks
  echo "$EXPECTED_STAMP" > "$STAMP"
  log "horovod $HOROVOD_VERSION ready from the cache (no build); stamp: $STAMP"
  exit 0
fi

CMAKE_BIN="$(dirname "$PYTHON")/cmake"
if [[ ! -x "$CMAKE_BIN" ]]; then
  CMAKE_BIN="$(command -v cmake || true)"
  [[ -n "$CMAKE_BIN" ]] || die "cmake not found: pip install cmake (it is in requirements.txt) or apt-get install cmake"
fi

mkdir -p "$BUILD_DIR"
SDIST_DIR="$BUILD_DIR/horovod-sdist"
SDIST="$SDIST_DIR/horovod-$HOROVOD_VERSION.tar.gz"
SRC_DIR="$BUILD_DIR/horovod-$HOROVOD_VERSION"

if [[ ! -f "$SDIST" ]]; then
  log "downloading horovod $HOROVOD_VERSION sdist"
  if ! download_out="$("$PYTHON" -m pip download --no-deps --no-binary :all: \
      "horovod==$HOROVOD_VERSION" -d "$SDIST_DIR" 2>&1)"; then
    echo "$download_out" >&2
    die "step 'download horovod sdist' failed: pip could not fetch horovod==$HOROVOD_VERSION"
  fi
fi
actual_sha="$(sha256sum "$SDIST" | cut -d' ' -f1)"
if [[ "$actual_sha" != "$HOROVOD_SDIST_SHA256" ]]; then
  rm -f "$SDIST"
  die "sdist checksum mismatch for horovod $HOROVOD_VERSION (got $actual_sha, want $HOROVOD_SDIST_SHA256); deleted it, rerun to download again"
fi

# Unpack fresh every time so the patch always applies to pristine source.
log "unpacking sdist into $SRC_DIR"
rm -rf "$SRC_DIR"
tar -xzf "$SDIST" -C "$BUILD_DIR"

# Third patch, first applied: horovodrun keeps what the build has (Gloo, MPI, ...)
# instead of importing TensorFlow in a forked process at every launch to learn it
# (9.5 s of each launch on a 2-core machine; scripts/patch_horovod_checks.py says more).
"$PYTHON" "$REPO_ROOT/scripts/patch_horovod_checks.py" "$SRC_DIR" \
  || die "patch failed: scripts/patch_horovod_checks.py (its message above)"
log "patched horovod/common/util.py: horovodrun's build checks kept beside the extension"
# Fourth patch: an elastic horovodrun whose discovery script lists one host name,
# without --network-interface, fails in one line instead of waiting 10 minutes.
"$PYTHON" "$REPO_ROOT/scripts/patch_horovod_elastic.py" "$SRC_DIR" \
  || die "patch failed: scripts/patch_horovod_elastic.py (its message above)"
log "patched horovod/runner/gloo_run.py: elastic on one host name is one error line"

# The patch: remove exactly one line, and refuse to build if the sdist does
# not look the way we expect (a changed sdist must not build unpatched).
TF_CMAKE="$SRC_DIR/horovod/tensorflow/CMakeLists.txt"
[[ -f "$TF_CMAKE" ]] || die "patch failed: $TF_CMAKE not found in the sdist"
xla_count="$(grep -cxF "$XLA_LINE" "$TF_CMAKE" || true)"
[[ "$xla_count" == "1" ]] \
  || die "patch failed: expected exactly 1 line '$XLA_LINE' in $TF_CMAKE, found $xla_count"
grep -vxF "$XLA_LINE" "$TF_CMAKE" > "$TF_CMAKE.patched"
mv "$TF_CMAKE.patched" "$TF_CMAKE"
if grep -q "xla_mpi_ops" "$TF_CMAKE" || ! grep -qxF "$MPI_OPS_LINE" "$TF_CMAKE"; then
  die "patch failed: $TF_CMAKE does not look as expected after removing xla_mpi_ops.cc"
fi
log "patched $TF_CMAKE: dropped xla_mpi_ops.cc (does not compile against TF >= 2.16)"

# Second patch, for GPU builds: mpi_ops.cc declares
# stream_executor::gpu::AsGpuStreamValue() and leaves it to TensorFlow to
# define, but TF 2.21's libraries no longer export it (a stream's CUDA handle is
# Stream::platform_specific_handle() now), so a GPU build would fail to load
# with an undefined symbol. Define it right after the header that declares
# Stream. It sits under `#if HAVE_GPU`: CPU builds compile it out.
MPI_OPS_CC="$SRC_DIR/horovod/tensorflow/mpi_ops.cc"
[[ -f "$MPI_OPS_CC" ]] || die "patch failed: $MPI_OPS_CC not found in the sdist"
for expected in "$STREAM_DECL_LINE" "$STREAM_INCLUDE_LINE"; do
  count="$(grep -cxF "$expected" "$MPI_OPS_CC" || true)"
  [[ "$count" == "1" ]] \
    || die "patch failed: expected exactly 1 line '$expected' in $MPI_OPS_CC, found $count"
done
awk -v anchor="$STREAM_INCLUDE_LINE" '
  { print }
  $0 == anchor {
    print "namespace stream_executor {"
    print "namespace gpu {"
    print "// Added by tfgpt scripts/build_horovod.sh: TensorFlow 2.21 does not export this."
    print "GpuStreamHandle AsGpuStreamValue(Stream* stream) {"
    print "  return static_cast<GpuStreamHandle>(stream->platform_specific_handle().stream);"
    print "}"
    print "} // namespace gpu"
    print "} // namespace stream_executor"
  }' "$MPI_OPS_CC" > "$MPI_OPS_CC.patched"
mv "$MPI_OPS_CC.patched" "$MPI_OPS_CC"
[[ "$(grep -c 'platform_specific_handle' "$MPI_OPS_CC")" == "1" ]] \
  || die "patch failed: $MPI_OPS_CC does not look as expected after defining AsGpuStreamValue"
log "patched $MPI_OPS_CC: defined AsGpuStreamValue (TF 2.21 does not export it; GPU builds only)"

# From here on the installed horovod (if any) no longer matches the stamp.
rm -f "$STAMP"
if "$PYTHON" -m pip show horovod >/dev/null 2>&1; then
  log "removing the previously installed horovod"
  "$PYTHON" -m pip uninstall --yes --quiet horovod
fi

NPROC="$(nproc 2>/dev/null || echo 2)"
# Horovod's setup.py runs `make -j8` unless MAKEFLAGS is set; match the cores.
export MAKEFLAGS="${MAKEFLAGS:--j$NPROC}"
export HOROVOD_CMAKE="$CMAKE_BIN"
# gloo's CMakeLists.txt asks for cmake 2.8.12, which cmake >= 4 refuses
# without this; older cmake ignores the variable.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
# HOROVOD_GPU_OPERATIONS and the CUDA/NCCL variables reach Horovod's CMake
# through the environment as they are; unset, the build has no CUDA at all.

log "building horovod $HOROVOD_VERSION against tensorflow $TF_VERSION${GPU_OPERATIONS:+ with GPU operations $GPU_OPERATIONS (nvcc: $(find_nvcc))}"
log "  this compiles C++ against the TF headers and takes 2-5 minutes on 2 cores"
log "  (cmake $("$CMAKE_BIN" --version | head -1 | awk '{print $3}'), MAKEFLAGS=$MAKEFLAGS); full output: $LOG"

start=$SECONDS
BUILT_DIR="$BUILD_DIR/horovod-wheel"
rm -rf "$BUILT_DIR"
"$PYTHON" -m pip wheel --verbose --no-build-isolation --no-deps -w "$BUILT_DIR" "$SRC_DIR" \
  > "$LOG" 2>&1 &
pip_pid=$!
trap 'kill "$pip_pid" 2>/dev/null || true' INT TERM
while kill -0 "$pip_pid" 2>/dev/null; do
  for _ in $(seq 30); do
    kill -0 "$pip_pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$pip_pid" 2>/dev/null; then
    progress="$(grep -oE '\[ *[0-9]+%\]' "$LOG" | tail -1 || true)"
    log "  still building... $((SECONDS - start))s elapsed ${progress:+(cmake progress $progress)}"
  fi
done
if wait "$pip_pid"; then rc=0; else rc=$?; fi
trap - INT TERM

if [[ "$rc" != "0" ]]; then
  echo "----- last 40 lines of $LOG -----" >&2
  tail -n 40 "$LOG" >&2
  echo "---------------------------------" >&2
  die "step 'pip wheel horovod' failed (exit $rc) after $((SECONDS - start))s; full log: $LOG"
fi
log "build finished in $((SECONDS - start))s"
WHEEL="$(compgen -G "$BUILT_DIR/horovod-$HOROVOD_VERSION-*.whl" | head -1 || true)"
[[ -n "$WHEEL" ]] || die "step 'pip wheel horovod' made no wheel in $BUILT_DIR; full log: $LOG"
# With its dependencies (cloudpickle, psutil, pyyaml, ...): the wheel was built without them.
PYTHON="$PYTHON" "$REPO_ROOT/scripts/pip_install.sh" --quiet "$WHEEL" \
  || die "step 'pip install $WHEEL' failed"

if ! import_out="$("$PYTHON" -c 'import horovod, horovod.tensorflow as hvd; hvd.init(); print(f"horovod {horovod.__version__}, rank {hvd.rank()} of {hvd.size()}")' 2>&1)"; then
  echo "$import_out" >&2
  die "step 'import horovod.tensorflow; hvd.init()' failed after a successful build; see $LOG"
fi
log "import check: $(tail -n 1 <<<"$import_out")"
HOROVODRUN="$(dirname "$PYTHON")/horovodrun"
if ! check_out="$("$HOROVODRUN" --check-build 2>&1)" \
    || ! grep -q '\[X\] TensorFlow' <<<"$check_out" \
    || ! grep -q '\[X\] Gloo' <<<"$check_out" \
    || { [[ -n "$GPU_OPERATIONS" ]] && ! grep -q "\[X\] $GPU_OPERATIONS" <<<"$check_out"; }; then
  echo "$check_out" >&2
  die "step 'horovodrun --check-build' does not list TensorFlow and Gloo${GPU_OPERATIONS:+ and $GPU_OPERATIONS}"
fi

echo "$EXPECTED_STAMP" > "$STAMP"
# Kept for the next clone or venv on this machine: copied, then renamed into
# place, so a reader never finds half a wheel. A cache that cannot be written
# costs only the next build.
if mkdir -p "$WHEEL_DIR" 2>/dev/null && cp "$WHEEL" "$WHEEL_DIR/.partial" 2>/dev/null \
    && mv "$WHEEL_DIR/.partial" "$WHEEL_DIR/$(basename "$WHEEL")"; then
  log "wheel kept for later set-ups: $WHEEL_DIR/$(basename "$WHEEL")"
else
  log "could not keep the wheel in $WHEEL_DIR (the next set-up builds again)"
fi
log "horovod $HOROVOD_VERSION ready (TensorFlow + Gloo${GPU_OPERATIONS:+ + $GPU_OPERATIONS}); stamp: $STAMP"
