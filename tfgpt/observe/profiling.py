"""A TensorFlow profiler trace of chosen training steps (`--profile-steps`)."""

import os

import tensorflow as tf


class StepProfiler:
    """Records steps `start` to `end` (1-based, inclusive) in `directory`.

    The trace (`tf.profiler.experimental`) opens in TensorBoard's profile
    tab, and `python -m bench.profile_summary DIRECTORY` prints the time per
    kind of operation. Only the chief records (`enabled`), so N workers do
    not write N traces; a resumed run records the part of the range it runs.

    Args:
        steps: `(start, end)` or None (no trace).
        directory: str. Where the trace goes (OUT/profile).
        enabled: bool. False on every worker but the chief.

    Example:
    >>> profiler = StepProfiler((3, 4), "/tmp/profile", enabled=True)
    >>> for number in range(1, 6):
    ...     profiler.before(number)
    ...     metrics = {"loss": tf.constant(0.0)}  # a training step
    ...     profiler.after(number, metrics, last=number == 5)
    """

    def __init__(self, steps, directory, enabled):
        self.steps = steps if enabled else None
        self.directory = directory
        self.active = False

    def before(self, number):
        """Starts the trace if step `number` is the first one to record."""
        if self.steps and not self.active and self.steps[0] <= number <= self.steps[1]:
            os.makedirs(self.directory, exist_ok=True)
            tf.profiler.experimental.start(self.directory)
            self.active = True

    def after(self, number, metrics, last):
        """Stops the trace after the range's last step (or the run's);
        returns True when it did."""
        if not self.active or (number < self.steps[1] and not last):
            return False
        float(metrics["loss"])  # the step has finished before the trace ends
        tf.profiler.experimental.stop()
        self.active = False
        return True
