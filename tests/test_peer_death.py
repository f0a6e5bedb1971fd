"""A rank that dies or hangs mid-run: the others exit with an error in bounded time.

Rank 1 SIGKILLs itself as it starts step 3 (`tfgpt.resilience.faults`
KILL_AT_STEP) in a pipeline-parallel and a tensor-parallel run. Under
horovodrun, which ends the other ranks once one fails; and under
`tfgpt.slurm_launcher`, which does not: there the survivor has to find
out by itself (its next collective fails with "Horovod has been shut
down": Gloo sees the dead peer's connection close, or else the watchdog
ends it). A rank that stops (SIGSTOP) instead keeps its connections open,
and one that hangs in Python has Horovod's thread answering for it: the
watchdog (`tfgpt.resilience.watchdog`) ends the wait after
`--collective-timeout` and its grace, or the shared-memory average's own
wait after `--collective-timeout`, in data-parallel runs over either
transport, ZeRO-3, tensor-parallel and pipeline runs.
"""

import concurrent.futures
import json
import socket
import time

import psutil
import pytest

from tests.launch import REPO, checkpoint_tensors, horovodrun, slurm_tasks, train_losses
from tfgpt.checkpoint.files import latest
from tfgpt.resilience import faults

LAYOUTS = {
    "pipeline": ["--pipeline-parallel", "2", "--microbatches", "2", "--num-layers", "3"],
    "tensor": ["--tensor-parallel", "2", "--num-layers", "2"],
}
# A run left hanging would take TIMEOUT_SECONDS (tests/launch.py) to be killed.
BOUND_SECONDS = 120
# Gloo's timeout (30 s by default), low: a transfer to a stopped peer fails after it.
GLOO_TIMEOUT = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}
ENVIRONMENT = {**GLOO_TIMEOUT, faults.KILL_AT_STEP: "1:3"}


def _flags(tiny_data, out, layout):
    """train_hvd.py's flags; a `layout` of LAYOUTS, or None for its own."""
    return ["--data", tiny_data, "--out", out, "--steps", "8", "--batch-size", "4",
            "--log-every", "1", "--eval-batches", "1", "--num-heads", "2", "--hidden-dim", "32",
            "--intermediate-dim", "48", "--max-sequence-length", "16", *LAYOUTS.get(layout, [])]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_horovodrun_ends_with_an_error_when_a_rank_is_killed(tiny_data, tmp_path, layout):
    begin = time.monotonic()
    code, output = horovodrun(2, REPO / "train_hvd.py", *_flags(tiny_data, tmp_path, layout),
                              env=ENVIRONMENT, timeout=BOUND_SECONDS)
    assert time.monotonic() - begin < BOUND_SECONDS
    assert code != 0
    assert "Process 1 exit with status code 137" in output, output  # the SIGKILL
    assert sorted(train_losses(tmp_path)) == [1, 2]  # trained until the kill


# The tensor-parallel survivor hung into the 120 s bound on three loaded
# CI runs before the watchdog: now, if the dead peer's closed connection
# does not end it, the watchdog does (--collective-timeout 8).
SURVIVOR_ENDED_BY = ("a collective failed: ", "watchdog: rank 1 on ")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_survivor_exits_by_itself_without_horovodrun(tiny_data, tmp_path, layout):
    begin = time.monotonic()
    command = [REPO / "train_hvd.py", *_flags(tiny_data, tmp_path, layout),
               "--collective-timeout", "8"]
    results = slurm_tasks([command, command], timeout=BOUND_SECONDS, env=ENVIRONMENT)
    assert time.monotonic() - begin < BOUND_SECONDS
    (survivor, output), (killed, _) = results
    assert killed == 128 + 9
    assert survivor != 0
    [line] = [line for line in output.splitlines() if "error: rank 0 on " in line]
    assert any(f"error: rank 0 on {socket.gethostname()}: {words}" in line
               for words in SURVIVOR_ENDED_BY), output


# A rank that stops (SIGSTOP) or hangs in Python (its Horovod thread still
# answering) at step 3, after the checkpoint of step 2: the layout and
# transport, the fault, the rank whose line ends the run and its words.
# The watchdog (`tfgpt.resilience.watchdog`) ends a rank whose loop has not
# moved for --collective-timeout plus its grace (8 + 5.8 s), before Gloo's
# timeout (20 s); the shared-memory average's own wait, of
# --collective-timeout, ends first where it runs. The hung rank's own
# watchdog, whose loop stopped first, ends it first.
TIMEOUT = ["--collective-timeout", "8", "--save-every", "2"]
HANGS = {
    "data-shared-memory-stopped": (
        ["--num-layers", "2"], faults.STOP_AT_STEP, 0,
        "shared-memory allreduce: rank 0 waited", "for rank 1 (pid {pid})"),
    "data-horovod-stopped": (
        ["--num-layers", "2", "--allreduce-transport", "horovod"], faults.STOP_AT_STEP, 0,
        "watchdog: rank 1 on {host} (pid {pid}) stopped answering", ", said it "),
    "zero3-stopped": (
        ["--num-layers", "2", "--zero-stage", "3"], faults.STOP_AT_STEP, 0,
        "watchdog: rank 1 on {host} (pid {pid}) stopped answering", ", said it "),
    "pipeline-stopped": (
        LAYOUTS["pipeline"], faults.STOP_AT_STEP, 0,
        "watchdog: rank 1 on {host} (pid {pid}) stopped answering", ", said it "),
    "tensor-stopped": (
        LAYOUTS["tensor"], faults.STOP_AT_STEP, 0,
        "watchdog: rank 1 on {host} (pid {pid}) stopped answering", ", said it "),
    "zero3-hung": (
        ["--num-layers", "2", "--zero-stage", "3"], faults.HANG_AT_STEP, 1,
        "watchdog: this rank on {host} (pid {pid}) is alive but behind", "it last saved step 2"),
}


def left_running(pids, wait_seconds=10.0):
    """The processes of `pids` still running (not ended, not a zombie) after
    up to `wait_seconds`: horovodrun returns when its shells end, a moment
    before the workers it killed with them are gone."""
    deadline = time.monotonic() + wait_seconds
    while True:
        running = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


# The cases mostly wait out the timeout: they run at once, this many at a time.
CONCURRENT_HANGS = 3


@pytest.fixture(scope="module")
def hang_runs(tiny_data, tmp_path_factory):
    """`{case: (out, returncode, output, seconds)}` of the HANGS runs."""

    def launch(case):
        flags, fault = HANGS[case][:2]
        out = tmp_path_factory.mktemp(case)
        begin = time.monotonic()
        code, output = horovodrun(2, REPO / "train_hvd.py", *_flags(tiny_data, out, None),
                                  *flags, *TIMEOUT, env={**GLOO_TIMEOUT, fault: "1:3"},
                                  timeout=BOUND_SECONDS)
        return out, code, output, time.monotonic() - begin

    with concurrent.futures.ThreadPoolExecutor(CONCURRENT_HANGS) as pool:
        return dict(zip(sorted(HANGS), pool.map(launch, sorted(HANGS))))


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(HANGS))
def test_a_rank_that_stops_ends_the_run_within_the_timeout(hang_runs, case):
    """Every process ends within the bound, with one line naming rank 1, its
    host and pid, and the checkpoint of step 2 stays whole and the latest."""
    reporter, ended_by, detail = HANGS[case][2:]
    out, code, output, seconds = hang_runs[case]
    assert seconds < BOUND_SECONDS
    assert code != 0
    # The heartbeats (the watchdog's, left by processes that did not end
    # cleanly) name every rank's process: none is left.
    pids = {rank: json.loads((out / ".heartbeats" / f"rank-{rank}.json").read_text())["pid"]
            for rank in (0, 1)}
    assert not left_running(pids.values()), output
    [line] = [line for line in output.splitlines() if f"error: rank {reporter} on " in line]
    assert f"error: rank {reporter} on {socket.gethostname()}: " in line, output
    assert ended_by.format(host=socket.gethostname(), pid=pids[1]) in line, output
    assert detail.format(pid=pids[1]) in line, line
    assert sorted(train_losses(out)) == [1, 2]
    assert latest(str(out)).endswith("ckpt-2")
    assert checkpoint_tensors(out / "ckpt-2")["step"] == 2
