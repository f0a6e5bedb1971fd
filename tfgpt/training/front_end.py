"""What the four front ends share: their flags, running a core to an exit status, and the exit.

`train_hvd.py`, `train_mirrored.py`, `finetune_hvd.py` and
`finetune_mirrored.py` each parse their flags with `COMMAND.parse_flags`,
build their distribution, and hand both to `COMMAND.run`; a pair of them
differs only in its `COMMAND` (`TRAIN` or `FINETUNE`) or only in its
distribution lines. The cores are imported when run, after the flags are
parsed, so `--help` and flag errors never start TensorFlow.
"""

import importlib
import os
import socket
import sys
import traceback


class Command:
    """A kind of run: where its flag parser and its core live.

    Args:
        flags: str. Module whose `parse_flags(argv, description,
            options_class)` returns `(config, model_overrides, options)`.
        core: str. `"module:function"`, called as `function(config,
            model_overrides=..., distribution=..., callbacks=...)`; the
            callbacks are the test-only faults the environment asks for
            (`tfgpt.resilience.faults`), the preemption signal's
            handler (`tfgpt.resilience.preemption`) and the watchdog of
            ranks that stop taking part (`tfgpt.resilience.watchdog`).
    """

    def __init__(self, flags, core):
        self.flags = flags
        self.core = core

    def parse_flags(self, argv, description, options_class):
        """`(config, model_overrides, options)` from `argv`; exits 2 on a bad flag."""
        module = importlib.import_module(self.flags)
        return module.parse_flags(argv, description=description, options_class=options_class)

    def run(self, config, model_overrides, distribution):
        """Runs the core; returns 0, 75 after a preemption signal stopped it
        with a checkpoint (`tfgpt.resilience.preemption`), 2 after one
        `error:` line on stderr (a refused setting, a diverged loss, a
        checkpoint that could not be written), or 1 after the traceback of anything else
        (a failed collective, a peer that died), so that the process still
        ends through `exit_after_run`.

        `distribution` is a distribution object, or a callable that makes
        one (so that its refusals, such as sizes that do not fit the
        number of workers, are one `error:` line too).
        """
        # These start TensorFlow: not before the flags are parsed.
        from tfgpt.checkpoint.run import SaveFailed
        from tfgpt.resilience import faults
        from tfgpt.resilience.preemption import PREEMPTED_STATUS, Preemption
        from tfgpt.resilience.watchdog import Watchdog
        from tfgpt.training.loop import StoppedEarly, TrainingDiverged

        module, name = self.core.split(":")
        core = getattr(importlib.import_module(module), name)
        try:
            if callable(distribution):
                distribution = distribution()
            with Preemption(distribution, config.preemption_signal,
                            config.preemption_grace) as preemption, \
                    Watchdog.for_run(distribution, config.out) as watchdog:
                core(config, model_overrides=model_overrides, distribution=distribution,
                     callbacks=[*faults.from_environment(distribution), preemption, watchdog])
        except StoppedEarly as stopped:
            print(f"{stopped}; exiting with status {PREEMPTED_STATUS}: run again with --resume "
                  "to continue", file=sys.stderr)
            return PREEMPTED_STATUS
        except (ValueError, TrainingDiverged, SaveFailed) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except Exception as error:  # noqa: BLE001 - reported, and the exit below must still come
            # An exception left to the interpreter would end the process
            # through its normal teardown, which can wait forever on
            # Horovod's and TensorFlow's threads once a peer has died.
            line = peer_failure(error, getattr(distribution, "rank", None))
            if line:
                print(f"error: {line}", file=sys.stderr)
            else:
                traceback.print_exc()
            return 1
        return 0


# A line of what a collective raises when a peer died, hung or stopped:
# the shared-memory average (its rank, its pid), Horovod's shutdown (its
# stall check names the ranks that did not submit), Gloo's transfers.
_PEER_FAILURES = ("shared-memory allreduce: rank", "Horovod has been shut down",
                  "Timed out waiting", "Connection closed by peer")


def peer_failure(error, rank):
    """One line for an `error` that means a peer stopped taking part: this
    rank and host, and the collective's own words; None for any other error."""
    for line in str(getattr(error, "message", error)).splitlines():
        if any(marker in line for marker in _PEER_FAILURES):
            return f"rank {rank} on {socket.gethostname()}: a collective failed: {line.strip()}"
    return None


TRAIN = Command("tfgpt.training.flags", "tfgpt.training.trainer:train")
FINETUNE = Command("tfgpt.finetuning.flags", "tfgpt.finetuning.finetuner:finetune")


def exit_after_run(status):
    """Ends a front end's process with `status`, skipping the interpreter's teardown.

    By the time a run returns, it has closed everything it wrote
    (checkpoints, config.json, metrics.jsonl, TensorBoard). What Python's
    normal exit does after that, tearing down TensorFlow's and Horovod's
    threads and objects, took seconds of idle time after the last log line
    (docs/logging.md; bench/RESULTS.md) and once ended a finished `horovodrun -np 2` run
    with a segmentation fault on one rank. So: flush the output, shut
    Horovod down if it runs and the run succeeded (every collective is done
    by now; after a failure a peer may be gone, and Horovod's shutdown would
    wait for it), and leave.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    hvd = sys.modules.get("horovod.tensorflow")
    if status == 0 and hvd is not None and hvd.is_initialized():
        hvd.shutdown()
    os._exit(status)
