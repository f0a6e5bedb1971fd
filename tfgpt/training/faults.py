"""Test-only fault injection, read from the environment (unset: nothing happens).

- `KILL_AFTER_SAVE` = "STEP": every worker SIGKILLs itself once the
  checkpoint of STEP is on disk (resuming is exact; `loop.run_loop`).
- `SLOW_COMPUTE` = "RANK:SECONDS": that rank's forward pass starts SECONDS
  late, inside the measured compute (the monitor's time split and its
  straggler rule; `TrainStep`).
- `GROW_MIB` = "RANK:MIB": that rank keeps MIB more memory after every
  step (the monitor's memory-growth rule; `loop.run_loop`).
- `KILL_AT_STEP` = "RANK:STEP": the worker of that rank SIGKILLs itself
  as it starts step STEP (a worker lost mid-run; `starting_step`), unless
  its process started that step before: an elastic run's survivor that
  became RANK redoes the step and lives.
- `STOP_AT_STEP` = "RANK:STEP": the worker of that rank stops itself
  (SIGSTOP) as it starts step STEP: a peer that hangs without dying
  (`starting_step`).
- `RECORD_LOG` = "DIR": each worker of an elastic run appends one line per
  step to DIR/records-PID.txt: the formation, the step, the world size,
  its rank and `fingerprint` of each sequence of its batch
  (`tfgpt.training.elastic`; which sequences each step used).

Example:
>>> import os
>>> os.environ[SLOW_COMPUTE] = "1:0.25"
>>> for_rank(SLOW_COMPUTE, 1), for_rank(SLOW_COMPUTE, 0), for_rank(GROW_MIB, 1)
(0.25, 0.0, 0.0)
>>> del os.environ[SLOW_COMPUTE]
"""

import hashlib
import os
import signal

KILL_AFTER_SAVE = "TFGPT_FAULT_KILL_AFTER_SAVE"
SLOW_COMPUTE = "TFGPT_FAULT_SLOW_COMPUTE"
GROW_MIB = "TFGPT_FAULT_GROW_MIB"
KILL_AT_STEP = "TFGPT_FAULT_KILL_AT_STEP"
STOP_AT_STEP = "TFGPT_FAULT_STOP_AT_STEP"
RECORD_LOG = "TFGPT_DEBUG_RECORD_LOG"


def kill_after_save():
    """The step after whose checkpoint to die, or -1."""
    return int(os.environ.get(KILL_AFTER_SAVE, "-1"))


# The steps this process has started (`starting_step`).
_started_steps = set()


def starting_step(rank, step):
    """Called as each step starts: dies as `KILL_AT_STEP` says, stops as `STOP_AT_STEP` does."""
    if for_rank(KILL_AT_STEP, rank) == step and step not in _started_steps:
        os.kill(os.getpid(), signal.SIGKILL)
    if for_rank(STOP_AT_STEP, rank) == step:
        os.kill(os.getpid(), signal.SIGSTOP)
    _started_steps.add(step)


def for_rank(name, rank):
    """The value of a "RANK:VALUE" fault for `rank` (float), or 0.0."""
    spec = os.environ.get(name, "")
    if not spec:
        return 0.0
    target, value = spec.split(":")
    return float(value) if int(target) == rank else 0.0


def fingerprint(tokens):
    """A short hex digest of one sequence's token ids (`RECORD_LOG`)."""
    return hashlib.sha1(",".join(str(int(token)) for token in tokens).encode()).hexdigest()[:16]
