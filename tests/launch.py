"""Starting real worker processes from tests, with a bound on their time, and
reading the training losses their runs logged and the checkpoints they wrote."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfgpt.config.distribution import localhost_cluster

REPO = Path(__file__).resolve().parent.parent
MANY = REPO / "tests" / "hvd_scripts" / "many.py"
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



# Two names of this machine: Horovod's elastic driver blacklists a failed
# worker's host, and a host is all of its slots. One slot on each name lets
# one worker be lost while the other goes on; both resolve to 127.0.0.1, so
# the driver starts both workers locally (no ssh).
ELASTIC_HOSTS = ("localhost", "127.0.0.1")
# Seconds a failed host stays blacklisted before it may be listed again
# (`--blacklist-cooldown-range`; 1 is the lowest Horovod allows).
ELASTIC_COOLDOWN = (1, 1)


def elastic_horovodrun(directory, *command, on_poll=None, timeout=TIMEOUT_SECONDS, env=None,
                       slots=None, max_slots=None):
    """Runs `python command...` under elastic `horovodrun --host-discovery-script`.

    The discovery script prints `directory/hosts`, which starts with one
    slot on each of `ELASTIC_HOSTS` (two workers; `slots`: `{name: slots}`
    instead, `-np` their sum; `--max-np` `max_slots`, default `-np`); the
    driver reads it every second. `on_poll(hosts, output)` is called twice a second while
    the run lasts with the `ElasticHosts` (`drop`, `restore`) and the
    output so far, in which the driver names a failed host ("blacklist
    failing host: NAME", at `--log-level INFO`): the test's script of the
    world size. Returns `(returncode, output)`; the group is killed on
    timeout.
    """
    if not HOROVODRUN.exists():
        pytest.fail(f"{HOROVODRUN} not found: run `make setup` to build Horovod")
    directory = Path(directory)
    hosts = ElasticHosts(directory / "hosts")
    if slots is not None:
        hosts.set(slots)
    workers = sum(hosts.slots.values())
    script = directory / "discover-hosts.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts.path}\n")
    script.chmod(0o755)
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    environment.update(env or {})
    log = directory / "horovodrun.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [str(part) for part in [
                HOROVODRUN, "-np", workers, "--min-np", 1,
                "--max-np", max_slots or workers, "--host-discovery-script", script,
                "--network-interface", "lo", "--log-level", "INFO",
                "--blacklist-cooldown-range", *ELASTIC_COOLDOWN, "--elastic-timeout", 120,
                sys.executable, *command]],
            stdout=output, stderr=subprocess.STDOUT, text=True, env=environment, cwd=REPO,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while process.poll() is None:
                if time.monotonic() > deadline:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    pytest.fail(f"timed out after {timeout}s:\n{log.read_text()}")
                if on_poll is not None:
                    on_poll(hosts, log.read_text())
                time.sleep(0.5)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return process.returncode, log.read_text()


class ElasticHosts:
    """The hosts an elastic run's discovery script lists (`elastic_horovodrun`): one
    slot on each of `ELASTIC_HOSTS`, or what `set` lists."""

    def __init__(self, path):
        self.path = path
        self.listed = []
        self.restore()

    def set(self, slots):
        """Lists `slots`, `{name: slots}`."""
        self.path.write_text("".join(f"{name}:{count}\n" for name, count in slots.items()))
        self.slots = dict(slots)
        self.listed = list(slots)

    def drop(self, name):
        """Lists every host but `name`: its slot is gone."""
        self.set({host: 1 for host in ELASTIC_HOSTS if host != name})

    def restore(self):
        """Lists every host again."""
        self.set(dict.fromkeys(ELASTIC_HOSTS, 1))


def processes(commands, timeout=TIMEOUT_SECONDS):
    """Runs each `(command, extra environment)` of `commands` at once, from the repo root.

    Every process gets its own process group; all of them are killed when
    one outlives `timeout`. Returns `[(returncode, output)]` in `commands` order.
    """
    started = []
    for command, env in commands:
        environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO), **env)
        started.append(subprocess.Popen(
            [str(part) for part in command], env=environment, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        ))
    outputs = []
    try:
        for process in started:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return [(process.returncode, output) for process, output in zip(started, outputs)]


def slurm_tasks(commands, timeout=TIMEOUT_SECONDS, env=None):
    """Runs one `tfgpt.slurm_launcher` task per rank, each with its own command
    (`python ARGS...` of `commands[rank]`), on this host, as Slurm's tasks
    would run without horovodrun. Returns `[(returncode, output)]` by rank."""
    port = socket.socket()
    port.bind(("", 0))
    free_port = port.getsockname()[1]
    port.close()
    return processes([
        ([sys.executable, "-m", "tfgpt.slurm_launcher", "--hosts", f"localhost:{len(commands)}",
          "--rank", rank, "--port", free_port, "--", sys.executable, *command], env or {})
        for rank, command in enumerate(commands)
    ], timeout=timeout)


def _launch(ranks, *command):
    """`python command...` under `horovodrun -np ranks`, or alone when `ranks` is 0;
    fails the test with the output unless it exits 0. Returns the output."""
    if ranks == 0:
        code, output = run([sys.executable, *command])
    else:
        code, output = horovodrun(ranks, *command)
    assert code == 0, output
    return output


def _load(directory, tag, ranks):
    import numpy as np

    return [np.load(directory / f"{tag}-rank-{rank}.npz") for rank in range(max(ranks, 1))]


def run_and_load(script, directory, tag, ranks, *flags):
    """Runs a `tests/hvd_scripts` script that writes DIRECTORY/TAG-rank-R.npz.

    Under `horovodrun -np ranks`, or alone with `--global` (the one-process
    oracle) when `ranks` is 0. Returns the loaded files, in rank order.
    """
    _launch(ranks, script, directory, tag, *([] if ranks else ["--global"]), *flags)
    return _load(directory, tag, ranks)


def _many(runs):
    """`many.py`'s RUNS argument: `runs` as JSON, every argument a string."""

    def item(run):
        if isinstance(run, dict):
            return dict(run, argv=[str(argument) for argument in run["argv"]])
        return [str(argument) for argument in run]

    return json.dumps([item(run) for run in runs])


def launch_each(script, ranks, runs):
    """Runs `script` once for each argument list of `runs`, in one launch
    (`tests/hvd_scripts/many.py`): one after another in the same processes,
    each as it would alone. An item may also be `{"argv": [...], "env":
    {...}, "status": N}` (environment variables for that run alone, the
    status its `main` must return). `ranks` as `run_and_load`'s (no
    `--global` added). Returns the output."""
    return _launch(ranks, MANY, script, _many(runs))


def launch_until_killed(script, ranks, runs):
    """`launch_each` whose last run kills its processes (a fault such as
    `TFGPT_FAULT_KILL_AFTER_SAVE` in its `env`), so the launch fails:
    returns (status, output) unchecked. `ranks` 1 is one process."""
    if ranks == 1:
        return run([sys.executable, MANY, script, _many(runs)])
    return horovodrun(ranks, MANY, script, _many(runs))


def run_each(script, directory, ranks, runs):
    """`run_and_load` for several runs in one launch (`launch_each`).

    `runs` is a list of `(tag, *flags)`. Returns `{tag: files}`.
    """
    launch_each(script, ranks, [[directory, tag, *([] if ranks else ["--global"]), *flags]
                                for tag, *flags in runs])
    return {tag: _load(directory, tag, ranks) for tag, *_ in runs}


def saved_weights(result):
    """The `weight_0`, `weight_1`, ... arrays of a check script's file, in order."""
    keys = sorted((k for k in result if k.startswith("weight_")), key=lambda k: int(k[7:]))
    return [result[key] for key in keys]


def held_weights(result):
    """`{I: array}` of the `weight_I` a check script's file holds (a pipeline rank: its stage's)."""
    return {int(key[7:]): result[key] for key in result if key.startswith("weight_")}


def multi_worker(count, *command, timeout=TIMEOUT_SECONDS):
    """Runs `python command...` as `count` MultiWorkerMirrored workers on localhost.

    Each worker gets its index in `TF_CONFIG`; all of them are killed on
    timeout or failure. Returns `[(returncode, output)]` in worker order.
    """
    cluster = localhost_cluster(count)
    return processes(
        [([sys.executable, *command],
          {"TF_CONFIG": json.dumps({"cluster": cluster,
                                    "task": {"type": "worker", "index": index}})})
         for index in range(count)],
        timeout=timeout,
    )


def train_losses(run_dir):
    """The training loss a run logged at each step, from its metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def validation_loss(run_dir):
    """The validation loss a run logged at its end, from its metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    [loss] = [r["loss"] for r in records if r["split"] == "val"]
    return loss


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


def checkpoint_tensors(path):
    """`{key: array}` of the checkpoint directory `path` (`OUT/ckpt-S`): every
    global tensor joined from its chunks, each per-rank object as `key@rank`."""
    from tfgpt.checkpoint.files import Reader

    reader = Reader(str(path))
    try:
        tensors = {}
        for key, entry in reader.keys.items():
            per_rank = [chunk for chunk in entry["chunks"] if chunk.get("rank") is not None]
            if not per_rank:
                tensors[key] = reader.whole(key)
            for chunk in per_rank:
                tensors[f"{key}@{chunk['rank']}"] = reader.array(chunk, entry["dtype"])
        return tensors
    finally:
        reader.close()
