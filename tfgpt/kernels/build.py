"""Compiles tfgpt's fused CPU kernels against the installed TensorFlow.

Usage:
    python -m tfgpt.kernels.build [--force] [--jobs N]

Every `tfgpt/kernels/cc/*.cc` is compiled with `BASE_FLAGS`, the
instruction-set flags below and the flags TensorFlow reports
(`tf.sysconfig`), and linked into `tfgpt/kernels/_tfgpt_kernels.so`, next
to a stamp (`_tfgpt_kernels.json`) that records what it was built from:
the sha256 of the base flags, the sources and the headers they share
(`cc/*.h`), the TensorFlow version and the instruction-set flags. `make
setup` runs this; a second run with nothing changed is a no-op. A copy
of the library is kept in `TFGPT_CACHE_DIR` (default `~/.cache/tfgpt`)
under the stamp, the compiler's version and the machine: another clone
or venv on the machine takes it instead of compiling (`--force` compiles).
`tfgpt.kernels` loads the library only while the stamp matches, and
otherwise falls back to TensorFlow's own (slower) ops with a warning.

Instruction sets: AVX2 and FMA when this CPU has both (x86-64 machines of
the last decade), plus AVX-512 F/BW/DQ/VL when it has those too, else the
compiler's default. The stamp records the choice, and the loader refuses a
library built for instructions the CPU it runs on lacks (a copied venv or
Docker image), instead of crashing.
"""

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.join(HERE, "cc")
LIBRARY = os.path.join(HERE, "_tfgpt_kernels.so")
STAMP = os.path.join(HERE, "_tfgpt_kernels.json")
COMPILER = os.environ.get("CXX", "g++")
# Every source's flags besides the instruction sets and TensorFlow's own.
# NDEBUG: TensorFlow's flags leave Eigen's per-coefficient asserts on.
BASE_FLAGS = ["-O3", "-DNDEBUG", "-fPIC", "-Wno-deprecated-declarations"]
# CPU feature flag in /proc/cpuinfo -> compiler flag, in tiers: a tier is
# taken when the CPU has every feature of it and of the tiers before it.
_X86_TIERS = (
    {"avx2": "-mavx2", "fma": "-mfma"},
    # AVX-512 doubles the width of Eigen's packets, which the attention
    # kernel's matmuls need to keep up with oneDNN's.
    {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512dq": "-mavx512dq",
     "avx512vl": "-mavx512vl"},
)
_X86_FEATURES = {feature: flag for tier in _X86_TIERS for feature, flag in tier.items()}


class BuildError(RuntimeError):
    """The kernels could not be compiled; the message says why and what to do."""


def sources():
    """The kernel sources, sorted by name."""
    if not os.path.isdir(SOURCE_DIR):
        return []
    return sorted(
        os.path.join(SOURCE_DIR, name) for name in os.listdir(SOURCE_DIR) if name.endswith(".cc")
    )


def cpu_features():
    """The CPU's feature flags (x86 /proc/cpuinfo `flags`), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_flags(features=None):
    """Instruction-set flags for this CPU: AVX2 + FMA if it has both, and
    AVX-512 (F, BW, DQ, VL) on top if it has all four as well."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    features = cpu_features() if features is None else features
    flags = []
    for tier in _X86_TIERS:
        if not all(feature in features for feature in tier):
            break
        flags.extend(tier.values())
    return flags


def required_features(flags):
    """CPU feature flags a library built with `flags` needs at run time."""
    return sorted(feature for feature, flag in _X86_FEATURES.items() if flag in flags)


def headers():
    """The headers the sources include (`cc/*.h`), sorted by name."""
    if not os.path.isdir(SOURCE_DIR):
        return []
    return sorted(
        os.path.join(SOURCE_DIR, name) for name in os.listdir(SOURCE_DIR) if name.endswith(".h")
    )


def fingerprint(tf_version, flags):
    """What a built library must match to be loaded: sources, TF, flags."""
    digest = hashlib.sha256(" ".join(BASE_FLAGS).encode())
    for path in sources() + headers():
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as file:
            digest.update(file.read())
    return {"sources_sha256": digest.hexdigest(), "tensorflow": tf_version, "flags": flags}


def read_stamp():
    try:
        with open(STAMP) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def is_current(tf_version, flags):
    """True when the built library matches the sources, TF and flags."""
    stamp = read_stamp()
    return (
        os.path.exists(LIBRARY)
        and stamp is not None
        and stamp.get("fingerprint") == fingerprint(tf_version, flags)
    )


def _cache_path(stamp_fingerprint):
    """Where a library of `stamp_fingerprint` built with this compiler on this
    kind of machine is kept for other clones and venvs (`TFGPT_CACHE_DIR`,
    `tfgpt.observe.flops.cache_directory`), or None without a compiler."""
    from tfgpt.observe.flops import cache_directory

    try:
        version = subprocess.run([COMPILER, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        return None
    key = json.dumps([stamp_fingerprint, version, platform.machine()], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_directory(), "kernels", digest, os.path.basename(LIBRARY))


def _install(library, tf_version, flags, paths):
    """Puts `library` (a built file) in place, then its stamp, each atomically:
    an interrupted install leaves no stamp that matches a half-written library."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(STAMP)
    os.replace(library, LIBRARY)
    stamp = {
        "fingerprint": fingerprint(tf_version, flags),
        "requires_cpu_features": required_features(flags),
        "sources": [os.path.basename(p) for p in paths],
    }
    with open(STAMP + ".partial", "w") as file:
        json.dump(stamp, file, indent=2)
    os.replace(STAMP + ".partial", STAMP)


def _compile(command):
    result = subprocess.run(command, capture_output=True, text=True)
    return result.returncode, result.stderr


@contextlib.contextmanager
def _lock():
    # Several processes (horovodrun ranks, pytest workers) may build at once.
    with open(os.path.join(HERE, ".build.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(force=False, jobs=None, log=print):
    """Compiles the kernels unless the library is current; returns its path.

    Raises:
        BuildError: no compiler, or a source failed to compile or link
            (the message carries the compiler's last lines).
    """
    import tensorflow as tf

    flags = isa_flags()
    with _lock():
        if not force and is_current(tf.__version__, flags):
            log(f"[kernels] up to date: {LIBRARY}")
            return LIBRARY
        if shutil.which(COMPILER) is None:
            raise BuildError(
                f"C++ compiler {COMPILER!r} not found: install g++ (apt-get install g++) "
                "or set CXX; without the kernels tfgpt runs TensorFlow's slower composite ops"
            )
        paths = sources()
        if not paths:
            raise BuildError(f"no kernel sources (*.cc) in {SOURCE_DIR}")
        cached = _cache_path(fingerprint(tf.__version__, flags))
        if not force and cached and os.path.exists(cached):
            shutil.copyfile(cached, LIBRARY + ".partial")
            _install(LIBRARY + ".partial", tf.__version__, flags, paths)
            log(f"[kernels] {LIBRARY}: the library built earlier on this machine ({cached})")
            return LIBRARY
        compile_flags = tf.sysconfig.get_compile_flags()
        link_flags = tf.sysconfig.get_link_flags()
        common = [*BASE_FLAGS, *flags, *compile_flags]
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="tfgpt-kernels-") as scratch:
            objects = [os.path.join(scratch, os.path.basename(p)[:-3] + ".o") for p in paths]
            commands = [
                [COMPILER, *common, "-c", path, "-o", obj] for path, obj in zip(paths, objects)
            ]
            log(f"[kernels] compiling {len(paths)} sources with {COMPILER} {' '.join(flags)}")
            with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
                results = list(pool.map(_compile, commands))
            for path, (code, stderr) in zip(paths, results):
                if code:
                    raise BuildError(
                        f"compiling {os.path.relpath(path, HERE)} failed (exit {code}):\n"
                        + _tail(stderr)
                    )
            partial = LIBRARY + ".partial"
            code, stderr = _compile(
                [COMPILER, "-shared", *objects, "-o", partial, *link_flags]
            )
            if code:
                raise BuildError(f"linking {os.path.basename(LIBRARY)} failed (exit {code}):\n"
                                 + _tail(stderr))
            _install(partial, tf.__version__, flags, paths)
        log(f"[kernels] built {LIBRARY} in {time.perf_counter() - start:.0f} s")
        if cached:  # kept for the next clone; a cache that cannot be written costs a build
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                shutil.copyfile(LIBRARY, cached + ".partial")
                os.replace(cached + ".partial", cached)
        return LIBRARY


def _tail(text, lines=30):
    kept = [line for line in text.splitlines() if "error" in line or "Error" in line]
    return "\n".join((kept or text.splitlines())[-lines:])


def main(argv=None):
    from tfgpt.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m tfgpt.kernels.build", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--force", action="store_true",
        help="rebuild even when the stamp says the library is up to date",
    )
    parser.add_argument(
        "--jobs", type=int, metavar="N",
        help="parallel compiler processes; unset: one per CPU core",
    )
    args = parser.parse_args(argv)
    try:
        build(force=args.force, jobs=args.jobs)
    except BuildError as error:
        print(f"[kernels] ERROR: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
