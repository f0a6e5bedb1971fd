"""What clusters do to long runs, in short runs.

Preemption (`tfgpt.resilience.preemption`): a signal that reaches one rank
stops every rank after the same step with a checkpoint and status 75, and
`--resume` goes on as the run that was never stopped, bit for bit. A save
that fails on one rank (`tfgpt.checkpoint.run.SaveFailed`) ends every rank
with one error line naming the checkpoint and leaves the previous one the
latest; an `--out` that cannot be written is refused before training.
"""

import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.launch import REPO, checkpoint_tensors, launch_each, train_losses
from tfgpt.checkpoint import RunCheckpointer, latest
from tfgpt.checkpoint import files as checkpoint_files
from tfgpt.checkpoint.run import SaveFailed
from tfgpt.config.training import TrainConfig
from tfgpt.parallel import LocalDistribution
from tfgpt.resilience.preemption import PREEMPTED_STATUS, Preemption
from tfgpt.training.loop import check_writable


class _TwoWorkers:
    """A distribution stand-in whose `allreduce_mean` averages this worker's
    value with a peer's, as Horovod's would."""

    num_workers = 2

    def __init__(self, peer_value):
        self.peer_value = peer_value

    def allreduce_mean(self, value):
        return (value + self.peer_value) / 2


def test_the_signal_is_caught_and_every_worker_hears_of_it():
    with Preemption(LocalDistribution(), "USR1", grace=60) as preemption:
        assert preemption.should_stop(1) is None
        signal.raise_signal(signal.SIGUSR1)  # caught: the process lives on
        assert preemption.should_stop(2) == "SIGUSR1"
    # Left: the previous handler is back and the grace timer stopped.
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    preemption._timer.join(timeout=5)
    assert not preemption._timer.is_alive()
    # A worker that did not get the signal hears of it through the collective;
    # without it anywhere, none stops.
    assert Preemption(_TwoWorkers(1.0)).should_stop(3) == "SIGTERM"
    assert Preemption(_TwoWorkers(0.0)).should_stop(3) is None
    with Preemption(LocalDistribution(), "off") as preemption:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert preemption.should_stop(1) is None


def test_a_run_that_does_not_stop_within_its_grace_exits_75_anyway():
    script = textwrap.dedent("""
        import os, signal, time
        from tfgpt.parallel import LocalDistribution
        from tfgpt.resilience.preemption import Preemption
        with Preemption(LocalDistribution(), "TERM", grace=0.5):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a step, a save or a peer that never ends
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == PREEMPTED_STATUS, result.stderr
    assert "SIGTERM caught" in result.stderr
    assert "did not stop within its grace of 0.5 s" in result.stderr


@pytest.mark.parametrize("fields, message", [
    ({"preemption_signal": "KILL"}, "preemption_signal"),
    ({"preemption_grace": 0.0}, "preemption_grace"),
])
def test_bad_preemption_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(data="unused", **fields)


def test_a_save_that_fails_keeps_the_previous_checkpoint_the_latest(tmp_path, monkeypatch):
    import errno

    import tensorflow as tf

    from tfgpt.checkpoint.state import Entry

    variable = tf.Variable([1.0, 2.0])
    checkpointer = RunCheckpointer(str(tmp_path), LocalDistribution(),
                                   lambda: [Entry("w", variable, (2,))])
    first = checkpointer.save(2)

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt-4"))

    monkeypatch.setattr(checkpoint_files, "write_rank", full_disk)
    variable.assign([3.0, 4.0])
    with pytest.raises(SaveFailed, match=r"ckpt-4 could not be written \(rank 0: .*No space "
                       r"left on device.*the latest checkpoint is still .*ckpt-2"):
        checkpointer.save(4)
    assert latest(str(tmp_path)) == first
    assert not (tmp_path / "ckpt-4").exists()
    checkpointer.restore_latest()
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])


def test_an_out_that_cannot_be_written_is_refused(tmp_path):
    check_writable(tmp_path / "new" / "run")  # made later, under a writable parent
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot be written: .*file is not a directory"):
        check_writable(tmp_path / "file" / "run")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]  # no probe left


TINY_MODEL = [
    "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]
STEPS = 6
LAYOUTS = {
    "data": [],  # on one host: averaged through shared memory
    "zero-3": ["--zero-stage", "3"],
    "tensor": ["--tensor-parallel", "2"],
    "pipeline": ["--pipeline-parallel", "2", "--microbatches", "2"],
    # Under plain horovodrun no worker joins; its checkpoints hold the
    # position in the global record order.
    "elastic": ["--elastic", "--commit-every", "2"],
}


def _flags(data, out, layout, *extra):
    return ["--data", data, "--out", out, "--steps", STEPS, "--log-every", "1",
            "--batch-size", "4", "--dropout", "0.0", "--eval-batches", "1",
            "--warmup-steps", "2", "--learning-rate", "3e-3", *TINY_MODEL, *LAYOUTS[layout],
            *extra]


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_with_a_checkpoint_and_resume_is_bitwise(
        tiny_data, tmp_path):
    """Two ranks, in one launch: an --out under a file (refused); each
    layout stopped by SIGTERM to rank 1 (the second replica, slice or
    stage) as it starts a step chosen per layout; a save that fails on
    rank 1 (its files limited to 4 KiB); each layout straight. A second
    launch resumes each layout's stopped run, which ends as the straight
    one, bit for bit."""
    from tfgpt.loading import load_model

    (tmp_path / "file").write_text("")
    unwritable = {"argv": _flags(tiny_data, tmp_path / "file" / "run", "data"), "status": 2}
    at = {layout: random.Random(layout).randint(2, STEPS - 1) for layout in LAYOUTS}
    straight = [_flags(tiny_data, tmp_path / layout, layout) for layout in LAYOUTS]
    stopped = [{"argv": _flags(tiny_data, tmp_path / f"{layout}-stopped", layout),
                "env": {"TFGPT_FAULT_SIGNAL_AT_STEP": f"1:{at[layout]}"},
                "status": PREEMPTED_STATUS} for layout in LAYOUTS]
    full = {"argv": _flags(tiny_data, tmp_path / "full", "data", "--save-every", "2"),
            "env": {"TFGPT_FAULT_WRITE_LIMIT_AT_STEP": "1:4"}, "status": 2}
    output = launch_each(REPO / "train_hvd.py", 2, [unwritable, *straight, *stopped, full])

    errors = [line for line in output.splitlines() if "error:" in line]
    refused = [line for line in errors if "--out" in line]
    assert len(refused) == 2 and all("file is not a directory" in line for line in refused), errors
    for layout, step in at.items():
        run = tmp_path / f"{layout}-stopped"
        # Both ranks stopped after the step the signal came in, with its checkpoint.
        assert output.count(f"SIGTERM: stopped after step {step}, saved") >= 2, (layout, output)
        assert (run / f"ckpt-{step}" / "index.json").exists(), layout
        assert not (run / f"ckpt-{STEPS}").exists(), layout
        assert sorted(train_losses(run)) == list(range(1, step + 1)), layout
    assert "shared memory" in output  # the data-parallel runs' transport
    # The failed save: one line on each rank, naming the checkpoint; the
    # previous checkpoint is the latest and reads whole.
    failed = [line for line in errors if "could not be written" in line]
    assert len(failed) == 2, errors
    assert all(f"the checkpoint {tmp_path / 'full' / 'ckpt-4'} could not be written" in line
               and f"still {tmp_path / 'full' / 'ckpt-2'}" in line for line in failed), failed
    # Rank 1's line names its file (its data position's: in data parallelism
    # the first replica alone writes the weights).
    assert any("rank 1: " in line and f"{tmp_path / 'full' / 'ckpt-4'}/data-00001-of-00002"
               in line for line in failed), failed
    assert latest(str(tmp_path / "full")) == str(tmp_path / "full" / "ckpt-2")
    assert not (tmp_path / "full" / "ckpt-4").exists()
    model, _ = load_model(str(tmp_path / "full"))
    assert len(model.generate([[5, 6, 7]], max_new_tokens=2)[0]) == 2

    launch_each(REPO / "train_hvd.py", 2, [
        _flags(tiny_data, tmp_path / f"{layout}-stopped", layout, "--resume")
        for layout in LAYOUTS])
    for layout in LAYOUTS:
        step = at[layout]
        expected, got = tmp_path / layout, tmp_path / f"{layout}-stopped"
        assert train_losses(got) == train_losses(expected), (layout, step)
        first, second = (checkpoint_tensors(run / f"ckpt-{STEPS}") for run in (expected, got))
        assert first.keys() == second.keys(), layout
        for key in first:
            np.testing.assert_array_equal(first[key], second[key], err_msg=f"{layout}: {key}")


def test_the_local_hosts_are_names_horovod_runs_workers_of_here(tmp_path):
    from horovod.runner.util.network import filter_local_addresses

    from tfgpt.resilience import local_hosts

    names = local_hosts.local_names()
    assert names[:2] == ["localhost", "127.0.0.1"] and len(set(names)) == len(names)
    assert filter_local_addresses(names) == []  # every one started here, without ssh
    script = REPO / "deploy" / "local" / "discover_hosts.sh"
    listed = subprocess.run([script], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "TFGPT_LOCAL_WORKERS": "2"})
    assert listed.stdout.split() == ["localhost:1", "127.0.0.1:1"], listed.stderr
    too_many = subprocess.run([script], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "TFGPT_LOCAL_WORKERS": "99"})
    assert too_many.returncode == 2 and "COUNT must be 0 (all) to" in too_many.stderr


@pytest.mark.distributed
def test_elastic_horovodrun_on_one_host_name_is_one_line_not_a_ten_minute_wait(tmp_path):
    from tests.launch import HOROVODRUN, run

    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    code, output = run([HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2",
                        "--host-discovery-script", script, sys.executable, "-c", "pass"],
                       timeout=120)
    assert code == 2, output
    assert ("the discovery script lists one (localhost): on one machine pass "
            "--network-interface lo") in output, output
