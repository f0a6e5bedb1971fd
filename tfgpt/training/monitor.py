"""Where each logging window's time goes on every worker, and the host's figures.

Per window, each worker measures four shares of the window's wall time:

- `data`: waiting for the next batch (the host's time in `next()` on the
  input iterator);
- `compute`: the step's forward and backward pass, from the step's start to
  its last local gradient (`tf.timestamp` ops in the step's graph,
  `tfgpt.training.train_step.STEP_TIMES`);
- `communication`: waiting for the averaged gradients after the backward
  pass, the part of the all-reduce (or ZeRO's reduce-scatter) that the
  backward pass did not hide (the same timestamps);
- `other`: the rest: the optimizer update, dispatch, logging, checkpoints.

and samples its process (`psutil`): CPU % over the window (100 per busy
core), resident set in MiB, and the host's I/O wait %. The chief gathers
every worker's row (`gather_rows`) and logs the mean shares with the
window's metrics and every row in `metrics.jsonl`.

Example:
>>> clock = WindowClock()
>>> clock.add("data", 0.0)
>>> sorted(clock.shares())
['communication', 'compute', 'data', 'other']
"""

import time

import numpy as np
import tensorflow as tf

SHARES = ("data", "compute", "communication", "other")
HOST = ("cpu_percent", "rss_mib", "iowait_percent")
COLUMNS = SHARES + HOST


class WindowClock:
    """One worker's seconds per part of a logging window (see the module docstring)."""

    def __init__(self):
        self.reset()

    def reset(self):
        """Starts a new window now."""
        self.start = time.perf_counter()
        self.seconds = dict.fromkeys(SHARES[:-1], 0.0)

    def add(self, part, seconds):
        """Adds `seconds` to `part` ("data", "compute" or "communication")."""
        self.seconds[part] += max(0.0, float(seconds))

    def add_step_times(self, step_times):
        """Adds a step's `STEP_TIMES` (compute, communication seconds), if it has them."""
        if step_times is not None:
            compute, communication = np.asarray(step_times, dtype=np.float64)
            self.add("compute", compute)
            self.add("communication", communication)

    def shares(self):
        """{part: share of the window's wall time so far}; `other` is the rest."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        shares = {part: seconds / elapsed for part, seconds in self.seconds.items()}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        return shares


class HostSampler:
    """This process's CPU % and resident set, and the host's I/O wait, per window.

    Each `sample()` covers the time since the previous one (the first, since
    construction). Without psutil's figures on this platform (I/O wait is
    Linux's), the missing value is 0.
    """

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._process = psutil.Process()
        self._process.cpu_percent(None)
        psutil.cpu_times_percent(None)

    def sample(self):
        times = self._psutil.cpu_times_percent(None)
        return {
            "cpu_percent": self._process.cpu_percent(None),
            "rss_mib": self._process.memory_info().rss / 2**20,
            "iowait_percent": float(getattr(times, "iowait", 0.0)),
        }


def gather_rows(distribution, row):
    """Every worker's `row` (floats), on every worker: a (workers, len(row)) array.

    One collective: each worker fills its own row of a zero matrix and the
    workers average it (`distribution.allreduce_mean`), so every row arrives
    divided by the worker count, which is multiplied back.
    """
    workers = distribution.num_workers
    matrix = np.zeros((workers, len(row)), np.float64)
    matrix[distribution.rank] = row
    mean = distribution.allreduce_mean(tf.constant(matrix, tf.float64))
    return np.asarray(mean, np.float64) * workers


def window_figures(distribution, clock, host):
    """The window's shares and host figures of every worker, gathered (all call it).

    Returns:
        `(means, rows)`: `means` maps `time_<part>` to the mean share over
        the workers; `rows` is one dict per worker (`rank` and `COLUMNS`).
    """
    shares = clock.shares()
    sampled = host.sample()
    matrix = gather_rows(distribution, [shares[p] for p in SHARES] + [sampled[h] for h in HOST])
    rows = [{"rank": rank, **{name: float(value) for name, value in zip(COLUMNS, row)}}
            for rank, row in enumerate(matrix)]
    means = {f"time_{part}": float(matrix[:, index].mean()) for index, part in enumerate(SHARES)}
    return means, rows
