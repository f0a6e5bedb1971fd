"""Test-only fault injection, read from the environment (unset: nothing happens).

- `KILL_AFTER_SAVE` = "STEP": every worker SIGKILLs itself once the
  checkpoint of STEP is on disk (resuming is exact; `loop.run_loop`).
- `SLOW_COMPUTE` = "RANK:SECONDS": that rank's forward pass starts SECONDS
  late, inside the measured compute (the monitor's time split and its
  straggler rule; `TrainStep`).
- `GROW_MIB` = "RANK:MIB": that rank keeps MIB more memory after every
  step (the monitor's memory-growth rule; `loop.run_loop`).

Example:
>>> import os
>>> os.environ[SLOW_COMPUTE] = "1:0.25"
>>> for_rank(SLOW_COMPUTE, 1), for_rank(SLOW_COMPUTE, 0), for_rank(GROW_MIB, 1)
(0.25, 0.0, 0.0)
>>> del os.environ[SLOW_COMPUTE]
"""

import os

KILL_AFTER_SAVE = "TFGPT_FAULT_KILL_AFTER_SAVE"
SLOW_COMPUTE = "TFGPT_FAULT_SLOW_COMPUTE"
GROW_MIB = "TFGPT_FAULT_GROW_MIB"


def kill_after_save():
    """The step after whose checkpoint to die, or -1."""
    return int(os.environ.get(KILL_AFTER_SAVE, "-1"))


def for_rank(name, rank):
    """The value of a "RANK:VALUE" fault for `rank` (float), or 0.0."""
    spec = os.environ.get(name, "")
    if not spec:
        return 0.0
    target, value = spec.split(":")
    return float(value) if int(target) == rank else 0.0
