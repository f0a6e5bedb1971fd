"""Test-only fault injection: a loop callback configured from the environment.

Unset, nothing happens (`from_environment` returns no callback). Each
variable names a fault; "RANK:VALUE" faults act on the worker whose rank
is RANK when the fault is due (an elastic run's ranks change):

- `KILL_AFTER_SAVE` = "STEP": every worker SIGKILLs itself once the
  checkpoint of STEP is on disk (resuming is exact; `on_save`).
- `SLOW_COMPUTE` = "RANK:SECONDS": that rank's forward pass starts SECONDS
  late, inside the measured compute (the monitor's time split and its
  straggler rule; `compute_delay`, which the train step takes).
- `GROW_MIB` = "RANK:MIB": that rank keeps MIB more memory after every
  step (the monitor's memory-growth rule; `on_step_end`).
- `KILL_AT_STEP` = "RANK:STEP": the worker of that rank SIGKILLs itself
  as it starts step STEP (a worker lost mid-run; `on_step_begin`), unless
  its process started that step before: an elastic run's survivor that
  became RANK redoes the step and lives.
- `STOP_AT_STEP` = "RANK:STEP": the worker of that rank stops itself
  (SIGSTOP) as it starts step STEP: a peer that hangs without dying.
- `HANG_AT_STEP` = "RANK:STEP": the worker of that rank hangs in Python
  as it starts step STEP (sleeps forever, its Horovod thread still
  answering): a stuck reader or lock (`tfgpt.resilience.watchdog`).
- `SIGNAL_AT_STEP` = "RANK:STEP": the worker of that rank sends itself
  SIGTERM as it starts step STEP: a scheduler's preemption that reaches
  one rank (`tfgpt.resilience.preemption`).
- `WRITE_LIMIT_AT_STEP` = "RANK:STEP": once step STEP is done, the worker
  of that rank can write no file past 4 KiB (its `RLIMIT_FSIZE`; a write
  past it fails with EFBIG, as one onto a full disk fails with ENOSPC):
  the checkpoint of STEP fails on that rank alone (`on_step_end`). The
  limit stays for the rest of the process.
- `RECORD_LOG` = "DIR": each worker of an elastic run appends one line per
  step to DIR/records-PID.txt: the formation, the step, the world size,
  its rank, `state_fingerprint` of the model's variables as the step
  starts and `fingerprint` of each sequence of its batch
  (`tfgpt.resilience.elastic`; which state each step started from and
  which sequences it used).

Example:
>>> from tfgpt.parallel import LocalDistribution
>>> fault = FaultInjection(LocalDistribution(), slow_compute="0:0.25", grow_mib="1:8")
>>> fault.compute_delay(), fault.grow_mib()
(0.25, 0.0)
"""

import hashlib
import os
import resource
import signal
import time

import tensorflow as tf

from tfgpt.training.loop import Callback

KILL_AFTER_SAVE = "TFGPT_FAULT_KILL_AFTER_SAVE"
SLOW_COMPUTE = "TFGPT_FAULT_SLOW_COMPUTE"
GROW_MIB = "TFGPT_FAULT_GROW_MIB"
KILL_AT_STEP = "TFGPT_FAULT_KILL_AT_STEP"
STOP_AT_STEP = "TFGPT_FAULT_STOP_AT_STEP"
HANG_AT_STEP = "TFGPT_FAULT_HANG_AT_STEP"
SIGNAL_AT_STEP = "TFGPT_FAULT_SIGNAL_AT_STEP"
WRITE_LIMIT_AT_STEP = "TFGPT_FAULT_WRITE_LIMIT_AT_STEP"
RECORD_LOG = "TFGPT_DEBUG_RECORD_LOG"
_FAULTS = {KILL_AFTER_SAVE: "kill_after_save", SLOW_COMPUTE: "slow_compute",
           GROW_MIB: "grow_mib", KILL_AT_STEP: "kill_at_step", STOP_AT_STEP: "stop_at_step",
           HANG_AT_STEP: "hang_at_step",
           SIGNAL_AT_STEP: "signal_at_step", WRITE_LIMIT_AT_STEP: "write_limit_at_step"}


def from_environment(distribution, environ=os.environ):
    """`[FaultInjection]` as the `TFGPT_FAULT_*` variables say, or `[]` when none is set."""
    given = {argument: environ[name] for name, argument in _FAULTS.items() if environ.get(name)}
    return [FaultInjection(distribution, **given)] if given else []


class FaultInjection(Callback):
    """The faults above, as a `tfgpt.training.loop.Callback`.

    Args:
        distribution: the run's distribution object (its `rank` is read
            when a fault is due, and `allreduce_mean` is the barrier
            before the kill after a save).
        kill_after_save: str "STEP", or None.
        slow_compute, grow_mib, kill_at_step, stop_at_step, hang_at_step,
        signal_at_step, write_limit_at_step: str "RANK:VALUE", or None.
    """

    def __init__(self, distribution, kill_after_save=None, slow_compute=None, grow_mib=None,
                 kill_at_step=None, stop_at_step=None, hang_at_step=None,
                 signal_at_step=None, write_limit_at_step=None):
        self.distribution = distribution
        self._kill_after_save = int(kill_after_save) if kill_after_save else -1
        self._by_rank = {name: _rank_value(name, spec) for name, spec in (
            ("slow_compute", slow_compute), ("grow_mib", grow_mib),
            ("kill_at_step", kill_at_step), ("stop_at_step", stop_at_step),
            ("hang_at_step", hang_at_step),
            ("signal_at_step", signal_at_step), ("write_limit_at_step", write_limit_at_step))}
        self._started_steps = set()  # the steps this process has started
        self._kept = []

    def _for_rank(self, name):
        target, value = self._by_rank[name]
        return value if target == self.distribution.rank else 0.0

    def compute_delay(self):
        """Seconds this rank's forward pass starts late (`SLOW_COMPUTE`): the
        train step built now (each elastic formation builds its own) takes it."""
        return self._for_rank("slow_compute")

    def grow_mib(self):
        """MiB this rank keeps after every step (`GROW_MIB`)."""
        return self._for_rank("grow_mib")

    def on_step_begin(self, step):
        if self._for_rank("kill_at_step") == step and step not in self._started_steps:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._for_rank("stop_at_step") == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._for_rank("hang_at_step") == step:
            while True:
                time.sleep(1.0)
        if self._for_rank("signal_at_step") == step:
            os.kill(os.getpid(), signal.SIGTERM)
        self._started_steps.add(step)

    def on_step_end(self, step):
        if self._for_rank("write_limit_at_step") == step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        if self.grow_mib():
            self._kept.append(b"\1" * int(self.grow_mib() * 2**20))  # bytes written: resident

    def on_save(self, step):
        if step == self._kill_after_save:
            # Every worker dies once the chief's checkpoint is on disk.
            # Without the barrier a non-chief rank could die first, and
            # horovodrun would stop the chief mid-write.
            self.distribution.allreduce_mean(tf.constant(0.0))
            os.kill(os.getpid(), signal.SIGKILL)


def _rank_value(name, spec):
    """`(rank, value)` of a "RANK:VALUE" fault; `(-1, 0.0)` when unset."""
    if not spec:
        return -1, 0.0
    try:
        target, value = spec.split(":")
        return int(target), float(value)
    except ValueError:
        raise ValueError(f"the {name} fault must read RANK:VALUE. Received: {spec!r}") from None


def fingerprint(tokens):
    """A short hex digest of one sequence's token ids (`RECORD_LOG`)."""
    return hashlib.sha1(",".join(str(int(token)) for token in tokens).encode()).hexdigest()[:16]


def state_fingerprint(variables):
    """A short hex digest of the values of `variables` (`RECORD_LOG`): the
    same on every worker that holds the same state, bit for bit."""
    digest = hashlib.sha1()
    for variable in variables:
        digest.update(variable.numpy().tobytes())
    return digest.hexdigest()[:16]
