"""Progress of `pipelines.prepare`: one line per phase on stderr, and the counters behind it.

Each phase (scan, encode+write) reports documents, MB of text, MB/s, the
share of the input read and an ETA: redrawn in place on a terminal, or one
line every `PROGRESS_INTERVAL_SECONDS` otherwise (files, tests). Worker
processes add to shared counters that the main process reads.
"""

import sys
import time
from typing import Callable

PROGRESS_INTERVAL_SECONDS = 10.0
INTERACTIVE_PROGRESS_INTERVAL_SECONDS = 0.5


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A progress line for one phase: documents, MB, MB/s, percentage, ETA.

    On a terminal the line is redrawn in place on stderr; otherwise (files,
    tests) one line goes to `log` every `PROGRESS_INTERVAL_SECONDS`.
    """

    def __init__(
        self,
        phase: str,
        total_input_bytes: int,
        log: Callable[[str], None],
        interactive: bool = False,
    ):
        self.phase = phase
        self.total_input_bytes = max(total_input_bytes, 0)
        self.log = log
        self.interactive = interactive
        self.start = time.perf_counter()
        self._last_report = self.start
        self._drawn = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, documents: int, size: int, input_bytes: int) -> str:
        elapsed = max(self.elapsed(), 1e-9)
        text = (
            f"{self.phase}: {documents:,} documents, {size / 1e6:,.1f} MB, "
            f"{size / 1e6 / elapsed:,.1f} MB/s"
        )
        if self.total_input_bytes > 0:
            fraction = min(input_bytes / self.total_input_bytes, 1.0)
            eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
            text += f", {fraction:.0%}, ETA {_format_duration(eta) if eta == eta else '?'}"
        return text

    def update(self, documents: int, size: int, input_bytes: int) -> None:
        now = time.perf_counter()
        interval = (
            INTERACTIVE_PROGRESS_INTERVAL_SECONDS if self.interactive else PROGRESS_INTERVAL_SECONDS
        )
        if now - self._last_report < interval:
            return
        self._last_report = now
        if self.interactive:
            sys.stderr.write("\r[prepare] " + self.line(documents, size, input_bytes) + "\033[K")
            sys.stderr.flush()
            self._drawn = True
        else:
            self.log(self.line(documents, size, input_bytes))

    def done(self, documents: int, size: int, extra: str = "") -> None:
        if self._drawn:
            sys.stderr.write("\r\033[K")
        elapsed = max(self.elapsed(), 1e-9)
        self.log(
            f"{self.phase} done: {documents:,} documents, {size / 1e6:,.1f} MB, "
            f"{size / 1e6 / elapsed:,.1f} MB/s{extra} in {elapsed:.1f} s"
        )


class Counters:
    """documents, text bytes, input bytes: shared with workers, or local."""

    def __init__(self, shared=None):
        self._shared = shared
        self._local = [0, 0, 0]
        self.on_update = None

    def add(self, documents: int, text_bytes: int, input_bytes: int) -> None:
        if self._shared is not None:
            with self._shared.get_lock():
                self._shared[0] += documents
                self._shared[1] += text_bytes
                self._shared[2] += input_bytes
        else:
            self._local[0] += documents
            self._local[1] += text_bytes
            self._local[2] += input_bytes
            if self.on_update is not None:
                self.on_update()

    def values(self):
        if self._shared is not None:
            with self._shared.get_lock():
                return tuple(self._shared[:])
        return tuple(self._local)


def stderr_log(message: str) -> None:
    print(f"[prepare] {message}", file=sys.stderr, flush=True)
