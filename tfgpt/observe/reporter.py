"""Rank-0 logging: console lines, metrics.jsonl and TensorBoard scalars."""

import json
import math
import os
import sys
import time

import tensorflow as tf


class Reporter:
    """Writes metrics from the chief worker only; other workers stay silent.

    Args:
        out_dir: str. Where `metrics.jsonl` and `tensorboard/` go.
        is_chief: bool. Only the chief prints and writes.
        stream: file object for console lines; None writes to whatever
            `sys.stdout` is at the time (a default bound at import would
            keep a stream that a test harness or a redirect has replaced).
    """

    def __init__(self, out_dir, is_chief, stream=None):
        self.out_dir = out_dir
        self.stream = stream
        self.is_chief = False
        self._writer = None
        self._jsonl = None
        self.set_chief(is_chief)

    def set_chief(self, is_chief):
        """Starts writing when this worker becomes the chief (an elastic run lost rank 0)."""
        if is_chief and self._jsonl is None:
            os.makedirs(self.out_dir, exist_ok=True)
            self._writer = tf.summary.create_file_writer(os.path.join(self.out_dir, "tensorboard"))
            self._jsonl = open(os.path.join(self.out_dir, "metrics.jsonl"), "a", buffering=1)
        self.is_chief = is_chief

    def info(self, message):
        if self.is_chief:
            print(message, file=self.stream or sys.stdout, flush=True)

    def scalars(self, step, metrics, prefix="train", details=None):
        """Logs `metrics` (name -> float) at `step`: one console line, one JSON line.

        `details` (JSON-serialisable) goes into the JSON line; its
        `workers` rows (`tfgpt.observe.monitor.window_figures`: one dict
        per worker with its `rank`) also go to TensorBoard, as
        `<prefix>/worker_<rank>/<figure>`, so one rank's CPU, memory or
        time split can be plotted beside the others'. The `time_<part>` shares
        (`tfgpt.observe.monitor`) are one console field, in percent:
        `time data/compute/communication/other 1/80/6/13%`.
        """
        if not self.is_chief:
            return
        record = {"step": int(step), "split": prefix, "time": time.time()}
        record.update({name: float(value) for name, value in metrics.items()})
        record.update(details or {})
        self._jsonl.write(json.dumps(record) + "\n")
        with self._writer.as_default(step=int(step)):
            for name, value in metrics.items():
                tf.summary.scalar(f"{prefix}/{name}", float(value))
            for row in (details or {}).get("workers", ()):
                for name, value in row.items():
                    if name != "rank":
                        tf.summary.scalar(f"{prefix}/worker_{row['rank']}/{name}", float(value))
        self._writer.flush()
        parts = [f"{prefix} step {int(step):>6d}"]
        parts += [f"{name} {_format(value)}" for name, value in metrics.items()
                  if not name.startswith("time_")]
        shares = {name[5:]: value for name, value in metrics.items() if name.startswith("time_")}
        if shares:
            parts.append(f"time {'/'.join(shares)} "
                         + "/".join(f"{100 * value:.0f}" for value in shares.values()) + "%")
        self.info(" | ".join(parts))

    def close(self):
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()


def _format(value):
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-2 <= abs(value) < 1e5:
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:.3e}"
