"""Patches Horovod's sdist so that horovodrun asks each build question once.

Before starting any worker, every `horovodrun` asks whether Horovod was
built with Gloo (and MPI, NCCL, ...) by importing the framework extension,
TensorFlow included, in a forked process: 9.5 s of each launch on a 2-core
AMD EPYC Zen 3 (cProfile of `horovodrun -np 1 --gloo true`), though the
answer changes only with the build. The patched check keeps each answer in
`built_checks.json` beside the extension, keyed by the question and the
extension library's size and modification time: a rebuild asks again.
Questions about the running machine (`gpu_available`) are still asked every
time. The build's own `horovodrun --check-build` fills the file.

Usage: python scripts/patch_horovod_checks.py SDIST_SOURCE_DIR
Exits with an error, changing nothing, if `horovod/common/util.py` does not
look like 0.28.1's.
"""

import sys
from pathlib import Path

ORIGINAL = """    p.daemon = True
    p.start()
    p.join()
    return queue.get_nowait()
"""

START = """    # 'fork' is required because horovodrun is a frozen executable
    ctx = multiprocessing.get_context('fork')
"""

KEPT_START = """    # Patched by tfgpt (scripts/patch_horovod_checks.py): what the build has
    # is kept beside the extension, keyed by the question and the library's
    # size and time, instead of importing the framework at every launch.
    checks, checks_path, key = {}, None, None
    library = get_extension_full_path(__file__, '..', ext_base_name, 'mpi_lib')
    if (fn_desc == 'built' or fn_desc.startswith('built with ')) and os.path.exists(library):
        status = os.stat(library)
        key = '{} {} {}'.format(fn_desc, status.st_size, status.st_mtime_ns)
        checks_path = os.path.join(os.path.dirname(library), 'built_checks.json')
        try:
            with open(checks_path) as checks_file:
                checks = json.load(checks_file)
            if key in checks:
                return checks[key]
        except (OSError, ValueError):
            checks = {}

"""

KEPT_END = """    p.daemon = True
    p.start()
    p.join()
    result = queue.get_nowait()
    if key is not None and result is not None:
        checks[key] = result
        partial = '{}.{}.partial'.format(checks_path, os.getpid())
        try:
            with open(partial, 'w') as checks_file:
                json.dump(checks, checks_file)
            os.replace(partial, checks_path)
        except OSError:
            pass
    return result
"""


def patch(argv, relative_path, anchors, replacements):
    """Applies `replacements` (`[(old, new)]`) to SDIST/`relative_path`
    (`argv` is `[SDIST]`) if each of `anchors` occurs there exactly once;
    returns the exit status, changing nothing on an error."""
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0]) / relative_path
    if not path.is_file():
        print(f"patch failed: {path} not found in the sdist", file=sys.stderr)
        return 1
    source = path.read_text()
    counts = [source.count(anchor) for anchor in anchors]
    if counts != [1] * len(anchors):
        print(f"patch failed: {path} does not look like Horovod 0.28.1's "
              f"(anchors found {counts} times, expected once each)", file=sys.stderr)
        return 1
    for old, new in replacements:
        source = source.replace(old, new)
    path.write_text(source)
    return 0


def main(argv):
    return patch(argv, Path("horovod") / "common" / "util.py",
                 [ORIGINAL, START, "import json\n"],
                 [(START, KEPT_START + START), (ORIGINAL, KEPT_END)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
