"""Preemption: a signal stops every rank at one step boundary, after a checkpoint.

Schedulers end a job with a signal and a grace period before they kill
it: Slurm's `scancel` and preemption send SIGTERM and wait `KillWait`
(30 s by default), `sbatch --signal=USR1@90` sends SIGUSR1 90 s before
the time limit, a Kubernetes eviction sends SIGTERM and waits
`terminationGracePeriodSeconds` (30 s by default), and a spot reclaim
reaches only the ranks of the host it takes. So one rank may see the
signal and the others not.

A run (`--preemption-signal`, TERM by default) catches the signal and
carries on with its step. After each step every rank says whether it got
the signal, in one collective of one number, so all of them stop after
the same step; each saves the checkpoint of that step (as any save: the
previous checkpoint stays the latest until this one is committed) and
the process ends with status 75 (`PREEMPTED_STATUS`, sysexits'
EX_TEMPFAIL: run me again), which `deploy/slurm` requeues on. `--resume`
then continues from that step as if nothing had happened, data position
included. If the process has not ended `--preemption-grace` seconds
after the signal (a peer that never answers, a save slower than the
grace), it ends with status 75 anyway, before the scheduler's SIGKILL,
and the last committed checkpoint is the one to resume.

Under `horovodrun` on one host, signal the ranks (the scheduler does);
horovodrun itself, when signalled, kills its ranks 5 s later.
"""

import os
import signal
import sys
import threading
import time

import tensorflow as tf

from tfgpt.training.loop import Callback

PREEMPTED_STATUS = 75  # EX_TEMPFAIL (sysexits.h)
SIGNALS = {"TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2,
           "INT": signal.SIGINT, "off": None}


class Preemption(Callback):
    """Catches the preemption signal; after each step, `should_stop` says
    (the same on every rank) whether any rank has caught it.

    Use as a context manager: inside, the signal's handler is this one;
    on leaving, the previous handler is back and the grace timer stopped.

    Args:
        distribution: the run's distribution object (`allreduce_mean`
            over every rank, `num_workers`).
        signal_name: a key of `SIGNALS` ("off": nothing is caught).
        grace: seconds after the signal within which the process ends.
    """

    def __init__(self, distribution, signal_name="TERM", grace=25.0):
        self.distribution = distribution
        self.signal_name = signal_name
        self.signal = SIGNALS[signal_name]
        self.grace = float(grace)
        self.caught_at = None  # time.monotonic() of the first signal
        self._previous = None
        self._timer = None

    def __enter__(self):
        # A handler can only be set from the main thread (a run inside a
        # notebook's worker thread catches nothing).
        if self.signal is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signal, self._caught)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(self.signal, self._previous)
            self._previous = None
        if self._timer is not None:
            self._timer.cancel()

    def _caught(self, signum, frame):
        del signum, frame
        if self.caught_at is not None:
            return
        self.caught_at = time.monotonic()
        print(f"SIG{self.signal_name} caught: stopping after this step with a checkpoint "
              f"(within {self.grace:g} s, --preemption-grace)", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.grace, self._grace_ran_out)
        self._timer.daemon = True
        self._timer.start()

    def _grace_ran_out(self):
        print(f"error: SIG{self.signal_name}: the run did not stop within its grace of "
              f"{self.grace:g} s (--preemption-grace); exiting with status {PREEMPTED_STATUS} "
              "without a new checkpoint (the last committed one resumes)",
              file=sys.stderr, flush=True)
        os._exit(PREEMPTED_STATUS)

    def should_stop(self, step):
        """Whether any rank has caught the signal: one collective on every rank."""
        del step
        if self.signal is None:
            return None
        caught = float(self.caught_at is not None)
        if self.distribution.num_workers > 1:
            caught = float(self.distribution.allreduce_mean(tf.constant(caught)))
        if not caught:
            return None
        return f"SIG{self.signal_name}"
