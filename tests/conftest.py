"""Fixtures shared by the training tests, and the suite's account of its time.

The multi-process tests run one at a time (`pytest_collection_modifyitems`).
At the end of a run the suite prints the time each test file took (its
tests' set-up, call and tear-down, summed), the CPU time its tests used
(the test process and the processes it waited for: on a machine that both
workers keep busy, CPU time is what a test costs the suite, whatever ran
beside it), the tests that used the most CPU, and its own wall time against
the budget, `TFGPT_TEST_BUDGET_MINUTES` (default 40): the whole suite must
stay under it on a 2-core machine (bench/RESULTS.md, "Test suite").
"""

import collections
import os
import resource
import time

import pytest

from tests.synthetic import pattern_corpus

BUDGET_MINUTES = float(os.environ.get("TFGPT_TEST_BUDGET_MINUTES", "40"))
_FILE_SECONDS = collections.defaultdict(float)
_FILE_TESTS = collections.Counter()
_FILE_CPU = collections.defaultdict(float)
_TEST_CPU = {}
_START = time.monotonic()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The multi-process tests run one after another, on one worker.

    Each starts two to eight processes on a 2-core machine; two of them at
    once keep the ranks of both waiting on each other's collectives
    (bench/RESULTS.md, "Test suite"). Under `--dist loadgroup`
    (scripts/run_tests.sh) they are one group, which one worker takes
    first, in file order, the slow ones first; the other worker takes the
    single-process tests, the slow ones first. A module that names its own
    group keeps it: tests/test_docs_examples.py, whose few small
    `horovodrun -np 2` runs fit beside the single-process tests.
    """

    def kind(item):
        marks = {mark.name for mark in item.iter_markers()}
        return ("distributed" not in marks, "slow" not in marks)

    items.sort(key=kind)  # stable: the order within a kind stays
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("distributed") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("processes"))


def _cpu_seconds():
    """CPU time of this process and of the child processes it has waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_CPU_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and _CPU_START in item.stash:
        report.user_properties.append(("cpu_seconds", _cpu_seconds() - item.stash[_CPU_START]))


_CPU_START = pytest.StashKey[float]()


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] += report.duration
    if report.when == "call":
        _FILE_TESTS[path] += 1
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            _FILE_CPU[path] += value
            _TEST_CPU[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("time per test file (set-up, call and tear-down, summed)")
    write("    wall       CPU  tests  file   (CPU: the test processes and their children)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1]):
        write(f"{seconds:8.1f} s {_FILE_CPU[path]:8.1f} s  {_FILE_TESTS[path]:4d}  {path}")
    if _TEST_CPU:
        terminalreporter.section("the 15 tests that used the most CPU")
        for nodeid, seconds in sorted(_TEST_CPU.items(), key=lambda item: -item[1])[:15]:
            write(f"{seconds:8.1f} s  {nodeid}")
        write(f"{sum(_TEST_CPU.values()) / 60:.1f} CPU minutes in all")
    minutes = (time.monotonic() - _START) / 60
    verdict = "within" if minutes <= BUDGET_MINUTES else "OVER"
    terminalreporter.section(f"suite wall time {minutes:.1f} min: {verdict} the budget")
    write(f"suite wall time {minutes:.1f} min, {verdict} the budget of {BUDGET_MINUTES:g} min "
          "(TFGPT_TEST_BUDGET_MINUTES) on a 2-core machine; bench/RESULTS.md, 'Test suite', "
          "has the table per machine")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Packed records (seq_len 16, vocabulary 300) of `pattern_corpus`, in
    several shards of 8 KiB so that two workers shard by file."""
    from pipelines import prepare

    root = tmp_path_factory.mktemp("data")
    pattern_corpus(root / "corpus.txt")
    out = root / "prepared"
    code = prepare.main([
        "--input", str(root / "corpus.txt"), "--output", str(out),
        "--seq-len", "16", "--vocab-size", "300", "--shard-size", "8K",
        "--val-fraction", "0.1",
    ])
    assert code == 0
    return out


@pytest.fixture(scope="session", autouse=True)
def machine_cache(tmp_path_factory):
    """The suite's own `TFGPT_CACHE_DIR` (the measured matmul peak): the
    runs it starts share one measurement, and the user's cache is untouched."""
    directory = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("TFGPT_CACHE_DIR")
    os.environ["TFGPT_CACHE_DIR"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("TFGPT_CACHE_DIR", None)
    else:
        os.environ["TFGPT_CACHE_DIR"] = previous
