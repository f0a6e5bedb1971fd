"""Checks that the Horovod built by scripts/build_horovod.sh works.

`horovodrun --check-build` must list TensorFlow and Gloo, and a real
two-process Gloo job must compute a correct allreduce on every rank.
"""

import re
import sys
from pathlib import Path

import pytest

from tests import launch

HOROVOD_VERSION = "0.28.1"
HOROVODRUN = launch.HOROVODRUN
ALLREDUCE_SCRIPT = Path(__file__).parent / "hvd_scripts" / "allreduce_check.py"


def run(command):
    """`tests.launch.run`, after checking that horovodrun was installed."""
    if not HOROVODRUN.exists():
        pytest.fail(
            f"{HOROVODRUN} not found: Horovod is not installed in this venv; "
            "run scripts/setup.sh (or scripts/build_horovod.sh)"
        )
    return launch.run(command)


def parse_check_build(output):
    """Parse `horovodrun --check-build` into {section: {item: available}}."""
    sections = {}
    current = None
    for line in output.splitlines():
        heading = re.match(r"^Available (.+):$", line.strip())
        item = re.match(r"^\s*\[([X ])\]\s+(.+?)\s*$", line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
        elif item and current is not None:
            current[item.group(2)] = item.group(1) == "X"
    return sections


def test_parse_check_build_reads_marks():
    sample = (
        "Horovod v0.28.1:\n\nAvailable Frameworks:\n    [X] TensorFlow\n"
        "    [ ] PyTorch\n\nAvailable Controllers:\n    [ ] MPI\n    [X] Gloo\n"
    )
    assert parse_check_build(sample) == {
        "Frameworks": {"TensorFlow": True, "PyTorch": False},
        "Controllers": {"MPI": False, "Gloo": True},
    }


def test_check_build_lists_tensorflow_and_gloo():
    returncode, output = run([HOROVODRUN, "--check-build"])
    assert returncode == 0, output
    assert f"Horovod v{HOROVOD_VERSION}" in output, output
    sections = parse_check_build(output)
    assert sections.get("Frameworks", {}).get("TensorFlow") is True, output
    assert sections.get("Controllers", {}).get("Gloo") is True, output
    assert sections.get("Tensor Operations", {}).get("Gloo") is True, output


@pytest.mark.distributed
def test_two_process_allreduce_average_matches_numpy():
    num_processes = 2
    command = [
        HOROVODRUN,
        "-np", num_processes,
        "--gloo",
        "-H", f"localhost:{num_processes}",
        sys.executable, ALLREDUCE_SCRIPT, num_processes,
    ]
    returncode, output = run(command)
    assert returncode == 0, f"horovodrun exited {returncode}\n{output}"
    for rank in range(num_processes):
        # Both ranks must report, not just exit 0.
        assert f"rank {rank}/{num_processes} allreduce OK" in output, output


def test_the_build_keeps_horovodruns_checks_beside_the_extension():
    # The build's own --check-build answered the questions horovodrun asks
    # before each launch; they are kept, keyed by the library's size and time.
    import json

    import horovod

    library = next((Path(horovod.__file__).parent / "tensorflow").glob("mpi_lib*.so"))
    checks = json.loads((library.parent / "built_checks.json").read_text())
    status = library.stat()
    assert checks[f"built with Gloo {status.st_size} {status.st_mtime_ns}"] is True, checks
    assert checks[f"built with MPI {status.st_size} {status.st_mtime_ns}"] is False, checks


def test_the_check_patch_refuses_a_source_it_does_not_know(tmp_path):
    from scripts.patch_horovod_checks import KEPT_END, KEPT_START, START, main

    common = tmp_path / "horovod" / "common"
    common.mkdir(parents=True)
    original = (f"import json\n\ndef _check_extension_lambda():\n{START}    queue = 1\n"
                "    p.daemon = True\n    p.start()\n    p.join()\n    return queue.get_nowait()\n")
    (common / "util.py").write_text(original)
    assert main([str(tmp_path)]) == 0
    patched = (common / "util.py").read_text()
    assert KEPT_START + START in patched and patched.endswith(KEPT_END)
    # Patched already, or another Horovod: the anchors are gone, nothing changes.
    assert main([str(tmp_path)]) == 1
    assert (common / "util.py").read_text() == patched
    assert main([str(tmp_path / "missing")]) == 1
