"""Starting real worker processes from tests, with a bound on their time, and
reading the training losses their runs logged."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tfgpt.config.distribution import localhost_cluster

REPO = Path(__file__).resolve().parent.parent
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
# A hung rendezvous must fail the test, not block CI.
TIMEOUT_SECONDS = 300


def run(command, timeout=TIMEOUT_SECONDS, env=None):
    """Runs `command` in its own process group; returns (returncode, output).

    On timeout the whole group (horovodrun and its workers) is killed and
    the test fails with the output so far.
    """
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    environment.update(env or {})
    process = subprocess.Popen(
        [str(part) for part in command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, command))}\n{output}")
    return process.returncode, output


def horovodrun(num_workers, *command, timeout=TIMEOUT_SECONDS, env=None):
    """Runs `python command...` under `horovodrun -np N --gloo` on localhost."""
    if not HOROVODRUN.exists():
        pytest.fail(f"{HOROVODRUN} not found: run `make setup` to build Horovod")
    return run(
        [HOROVODRUN, "-np", num_workers, "--gloo", "-H", f"localhost:{num_workers}",
         sys.executable, *command],
        timeout=timeout,
        env=env,
    )




def train_check_script(script, out, tag, ranks, *flags):
    """Runs a check script that writes OUT/<tag>-rank-R.npz per rank: under
    `horovodrun -np ranks`, or (`ranks` 0) alone with `--global`, the
    one-process oracle. Returns the loaded files, one per rank."""
    import numpy as np

    if ranks == 0:
        code, output = run([sys.executable, script, out, tag, "--global", *flags])
    else:
        code, output = horovodrun(ranks, script, out, tag, *flags)
    assert code == 0, output
    return [np.load(out / f"{tag}-rank-{rank}.npz") for rank in range(max(ranks, 1))]


def saved_weights(result):
    """The `weight_0`, `weight_1`, ... arrays of a check script's file, in order."""
    keys = sorted((k for k in result if k.startswith("weight_")), key=lambda k: int(k[7:]))
    return [result[key] for key in keys]


def multi_worker(count, *command, timeout=TIMEOUT_SECONDS):
    """Runs `python command...` as `count` MultiWorkerMirrored workers on localhost.

    Each worker gets its index in `TF_CONFIG`; all of them are killed on
    timeout or failure. Returns `[(returncode, output)]` in worker order.
    """
    cluster = localhost_cluster(count)
    processes = []
    for index in range(count):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO),
                   TF_CONFIG=json.dumps({"cluster": cluster,
                                         "task": {"type": "worker", "index": index}}))
        processes.append(subprocess.Popen(
            [sys.executable, *map(str, command)], env=env, cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        ))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return [(process.returncode, output) for process, output in zip(processes, outputs)]


def train_losses(run_dir):
    """The training loss a run logged at each step, from its metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def assert_same_train_losses(reference, others, steps, tolerance):
    """The run `reference` logged a training loss at each of the steps 1 to
    `steps`, and each run of `others` the same losses within `tolerance`.

    Returns the reference's losses by step.
    """
    expected = train_losses(reference)
    assert sorted(expected) == list(range(1, steps + 1))
    for other in others:
        losses = train_losses(other)
        for step in expected:
            assert losses[step] == pytest.approx(expected[step], abs=tolerance), (other.name, step)
    return expected
