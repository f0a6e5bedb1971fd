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
core), resident set in MiB, and the host's I/O wait %; with an NVIDIA GPU
(NVML, `nvidia-ml-py`), the worker's GPU's utilisation % and memory in use
(MiB), left out of the rows when no worker has one. The chief gathers
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

SHARES = ("data", "compute", "communication", "other")
HOST = ("cpu_percent", "rss_mib", "iowait_percent", "gpu_percent", "gpu_memory_mib")
_NO_GPU = -1.0  # in the gathered matrix: this worker has no GPU to sample
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

    def elapsed(self):
        """Seconds since the window started."""
        return time.perf_counter() - self.start

    def shares(self):
        """{part: share of the window's wall time so far}; `other` is the rest."""
        elapsed = max(self.elapsed(), 1e-9)
        shares = {part: seconds / elapsed for part, seconds in self.seconds.items()}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        return shares


def _nvml_device(index):
    """NVML and the handle of GPU `index` (modulo the count), or None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if not count:
            return None
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index % count)
    except Exception:  # no package, no driver, no device: nothing to sample
        return None


class HostSampler:
    """This process's CPU % and resident set, the host's I/O wait, the GPU's figures.

    Each `sample()` covers the time since the previous one (the first, since
    construction). Without psutil's figures on this platform (I/O wait is
    Linux's), the missing value is 0; without a GPU (or NVML), the GPU
    figures are `_NO_GPU`.

    Args:
        gpu_index: int. The worker's GPU among the host's (its local rank).
    """

    def __init__(self, gpu_index=0):
        import psutil

        self._psutil = psutil
        self._process = psutil.Process()
        self._process.cpu_percent(None)
        psutil.cpu_times_percent(None)
        self._gpu = _nvml_device(gpu_index)

    def sample(self):
        times = self._psutil.cpu_times_percent(None)
        figures = {
            "cpu_percent": self._process.cpu_percent(None),
            "rss_mib": self._process.memory_info().rss / 2**20,
            "iowait_percent": float(getattr(times, "iowait", 0.0)),
            "gpu_percent": _NO_GPU,
            "gpu_memory_mib": _NO_GPU,
        }
        if self._gpu is not None:
            nvml, handle = self._gpu
            figures["gpu_percent"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            figures["gpu_memory_mib"] = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
        return figures


def gather_rows(distribution, row):
    """Every worker's `row` (floats), on every worker: a (workers, len(row)) array.

    One collective: each worker fills its own row of a zero matrix and the
    workers average it (`distribution.allreduce_mean`), so every row arrives
    divided by the worker count, which is multiplied back.
    """
    import tensorflow as tf  # here: tfgpt.report reads SHARES without TensorFlow

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
    gpus = bool((matrix[:, COLUMNS.index("gpu_percent")] != _NO_GPU).any())
    rows = [{"rank": rank, **{name: float(value) for name, value in zip(COLUMNS, row)
                              if gpus or not name.startswith("gpu_")}}
            for rank, row in enumerate(matrix)]
    means = {f"time_{part}": float(matrix[:, index].mean()) for index, part in enumerate(SHARES)}
    return means, rows


# ---- Rules: one warning line the first time each fires --------------------------

HOSTNAME_BYTES = 64


def hostnames(distribution):
    """Every worker's host name, by rank (one collective; names cut to 64 bytes)."""
    import socket

    name = socket.gethostname().encode()[:HOSTNAME_BYTES]
    row = np.zeros(HOSTNAME_BYTES)
    row[:len(name)] = np.frombuffer(name, np.uint8)
    return [bytes(np.rint(r).astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
            for r in gather_rows(distribution, row)]


class Rules:
    """Known problems, named from the windows' figures (chief side).

    `check(step, metrics, rows)` takes each logged window (its mean
    metrics and every worker's row, as `window_figures` gives them) and
    returns `(rule, message)` pairs for the rules that fire for the first
    time; a rule fires once per run. The rules and their thresholds:

    - `input-bound`: a worker waits for data more than 20% of the window.
    - `straggler`: one worker's compute share is above 1.2 times the
      median over the workers for 3 windows in a row.
    - `communication-bound`: every worker waits for the averaged
      gradients more than 25% of the window (if only some wait, the
      others are stragglers).
    - `low-utilisation`: a worker's GPU was busy less than half the
      window, or without GPUs its process (CPU time under 50% of one
      core): it mostly waited.
    - `memory-growth`: a worker's resident set grew in each of 5 windows
      in a row, by more than 1 MiB each time.
    - `loss-not-falling`: no new lowest loss in 10 windows.
    - `gradient-spike`: the gradient norm is above 5 times the median of
      the windows before (at least 5 of them).

    Args:
        hosts: list of str. Host name by rank (`hostnames`).
        pipeline: bool. The run is cut into pipeline stages, whose waits are
            the pipeline's transfers and bubble: `communication-bound` then
            names those and their remedies, not the gradient average's.
    """

    INPUT_SHARE = 0.20
    STRAGGLER_RATIO, STRAGGLER_WINDOWS = 1.2, 3
    COMMUNICATION_SHARE = 0.25
    BUSY_PERCENT = 50.0
    GROWTH_WINDOWS, GROWTH_MIB = 5, 1.0
    LOSS_WINDOWS = 10
    SPIKE_RATIO, SPIKE_HISTORY = 5.0, 5

    def __init__(self, hosts, pipeline=False):
        self.hosts = list(hosts)
        self.pipeline = pipeline
        self.fired = []
        self._slow_streak = {}  # rank -> windows in a row above the median
        self._growth_streak = {}
        self._last_rss = {}
        self._losses, self._norms = [], []

    def _where(self, rank):
        host = self.hosts[rank] if rank < len(self.hosts) else "?"
        return f"rank {rank} on {host}"

    def check(self, step, metrics, rows):
        found = []
        found += self._input(rows)
        found += self._straggler(rows)
        found += self._communication(rows)
        found += self._utilisation(rows)
        found += self._memory(rows)
        found += self._loss(metrics)
        found += self._gradient(metrics)
        new = []
        for rule, message in found:
            if rule not in {fired for fired, _, _ in self.fired}:
                self.fired.append((rule, int(step), message))
                new.append((rule, f"{rule} at step {int(step)}: {message}"))
        return new

    def _input(self, rows):
        worst = max(rows, key=lambda row: row["data"])
        if worst["data"] <= self.INPUT_SHARE:
            return []
        return [("input-bound", (
            f"{self._where(worst['rank'])} waited for its next batch {worst['data']:.0%} of "
            f"the time (over {self.INPUT_SHARE:.0%}). The input pipeline is slower than the "
            "step: read from a local disk, write uncompressed shards, or leave the reader "
            "a core (fewer --intra-op-threads)"
        ))]

    def _straggler(self, rows):
        if len(rows) < 2:
            return []
        median = float(np.median([row["compute"] for row in rows]))
        found = []
        for row in rows:
            slow = median > 0 and row["compute"] > self.STRAGGLER_RATIO * median
            streak = self._slow_streak.get(row["rank"], 0) + 1 if slow else 0
            self._slow_streak[row["rank"]] = streak
            if streak >= self.STRAGGLER_WINDOWS:
                found.append(("straggler", (
                    f"{self._where(row['rank'])} computed {row['compute'] / median:.1f} times "
                    f"the median worker's share for {streak} windows; the others wait for it. "
                    "Look for another process on its cores, a slower or throttled CPU, or a "
                    "busy disk there"
                )))
        return found[:1]

    def _communication(self, rows):
        least = min(rows, key=lambda row: row["communication"])
        if len(rows) < 2 or least["communication"] <= self.COMMUNICATION_SHARE:
            return []
        share = f"{least['communication']:.0%} of the time (over {self.COMMUNICATION_SHARE:.0%})"
        if self.pipeline:
            return [("communication-bound", (
                f"every stage waited for the pipeline's transfers and bubble more than {share}. "
                "Raise --microbatches, use --pipeline-schedule 1f1b, or fewer stages "
                "(--pipeline-parallel)"
            ))]
        return [("communication-bound", (
            f"every worker waited for the averaged gradients more than {share}. "
            "Raise the work per step (--batch-size, --accumulation-steps), use --fp16-allreduce, "
            "or a faster network"
        ))]

    def _utilisation(self, rows):
        with_gpu = [row for row in rows if row.get("gpu_percent", _NO_GPU) >= 0]
        field = "gpu_percent" if with_gpu else "cpu_percent"
        low = min(with_gpu or rows, key=lambda row: row[field])
        if low[field] >= self.BUSY_PERCENT:
            return []
        busy = "'s GPU was busy" if with_gpu else "'s process kept one core busy"
        return [("low-utilisation", (
            f"{self._where(low['rank'])}{busy} {low[field]:.0f}% of the time (under "
            f"{self.BUSY_PERCENT:.0f}%): it mostly waited. The time split says for what: "
            "data, the other workers, or the host"
        ))]

    def _memory(self, rows):
        found = []
        for row in rows:
            rank, rss = row["rank"], row["rss_mib"]
            previous = self._last_rss.get(rank)
            self._last_rss[rank] = rss
            grew = previous is not None and rss - previous > self.GROWTH_MIB
            streak = self._growth_streak.get(rank, 0) + 1 if grew else 0
            self._growth_streak[rank] = streak
            if streak >= self.GROWTH_WINDOWS:
                found.append(("memory-growth", (
                    f"{self._where(rank)}'s resident set grew in each of the last {streak} "
                    f"windows, to {rss:.0f} MiB. Something keeps a reference every step (a "
                    "list of tensors, a callback's history) or the input's buffers grow"
                )))
        return found[:1]

    def _loss(self, metrics):
        loss = metrics.get("loss")
        if loss is None:
            return []
        self._losses.append(float(loss))
        if len(self._losses) <= self.LOSS_WINDOWS:
            return []
        before = min(self._losses[:-self.LOSS_WINDOWS])
        if min(self._losses[-self.LOSS_WINDOWS:]) < before:
            return []
        return [("loss-not-falling", (
            f"no window of the last {self.LOSS_WINDOWS} went below the loss of {before:.4f} "
            "reached before them. Lower the learning rate, check the data for repeats, or stop"
        ))]

    def _gradient(self, metrics):
        norm = metrics.get("gradient_norm")
        if norm is None:
            return []
        norm = float(norm)
        history = list(self._norms)
        self._norms.append(norm)
        if len(history) < self.SPIKE_HISTORY:
            return []
        median = float(np.median(history))
        if not (median > 0 and norm > self.SPIKE_RATIO * median):
            return []
        return [("gradient-spike", (
            f"gradient norm {norm:.3g} is {norm / median:.1f} times the median of the "
            f"windows before ({median:.3g}). Lower the learning rate or clip "
            "(--gradient-clip-norm); a bad batch can cause it too"
        ))]
