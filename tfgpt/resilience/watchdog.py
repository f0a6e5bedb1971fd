"""A watchdog for ranks that stop taking part: the others end in bounded time, naming it.

The transports notice some of these faults by themselves: a dead peer
closes its connections, the shared-memory average gives up after
`--collective-timeout`, and Gloo's transfers after
`HOROVOD_GLOO_TIMEOUT_SECONDS`. Not all: a stopped rank (SIGSTOP, a
frozen host) keeps its connections open, and Horovod's negotiation waits
for it without end as often as not; a rank that hangs in Python between
steps (a stuck reader, a lock) still has Horovod's thread answering for
it, so nothing times out at all.

So every rank of a multi-worker run keeps a heartbeat in the run's
directory, `OUT/.heartbeats/rank-R.json`, written by a thread every few
seconds: a count that grows while the process runs, the last point of
the loop it passed ("began step 12", "ended step 12"), its host and pid.
The same thread reads the other ranks' heartbeats. When this rank's own
loop has not moved for `--collective-timeout` seconds plus a grace (the
transports' own timeouts, when they fire, speak first), it prints one
line naming the rank that holds the run up and ends the process with
status 1; horovodrun then ends the others. The rank it names:

- one whose heartbeat stopped changing: stopped, dead, or cut off;
- else the one furthest behind: alive, but not in the step the others
  wait in;
- else nobody: every rank waits in the same step (a deadlock, or a step
  longer than the timeout, which the default of 1800 s is not meant to
  be).

It needs `--out` on storage that every rank sees, as the checkpoints of a
sharded layout do; a rank that cannot see the others' heartbeats still
ends its own stalled wait, naming nobody. The watchdog watches the loop
from the first step to the end of the run, not the start-up before it.
The first step traces (and compiles) the step: it may outlast the timeout
while every rank is alive and in it, so there a rank is ended only when
another stopped answering or is behind.

Example (one rank judging the heartbeats it has read):
>>> seen = {0: Heartbeat(0, 40, 3 * 5, "began step 5", "a", 10, 30.0, 0.0),
...         1: Heartbeat(1, 12, 3 * 4 + 1, "ended step 4", "b", 11, 29.0, 0.0)}
>>> holder(seen, me=0, now=30.0, timeout=20.0)
'rank 1 on b (pid 11) is alive but behind: it last ended step 4, 30 s ago'
"""

import collections
import json
import os
import socket
import sys
import threading
import time

from tfgpt.training.loop import Callback

STATUS = 1  # what a failed collective ends a rank with (tfgpt.training.front_end)
DIRECTORY = ".heartbeats"

# One rank's heartbeat as another rank last read it: `beat` grows while
# its process runs, `progress` with its loop (`what` in words); `changed`
# and `moved` are the reader's clock when `beat` and `progress` last changed.
Heartbeat = collections.namedtuple(
    "Heartbeat", "rank beat progress what host pid changed moved")


def grace_seconds(timeout):
    """Seconds past `timeout` before the watchdog ends a stalled rank: the
    transports' own timeouts of the same length fire first."""
    return 5.0 + 0.1 * timeout


def holder(seen, me, now, timeout):
    """Which rank holds the run up, in words, from the heartbeats `seen`
    (`{rank: Heartbeat}`, this rank `me` among them); None when every rank
    is alive and in the same place."""
    others = [beat for rank, beat in sorted(seen.items()) if rank != me]
    for beat in others:
        if now - beat.changed < timeout:
            continue
        if beat.beat is None:
            return (f"rank {beat.rank} wrote no heartbeat in {now - beat.changed:.0f} s (it "
                    "stopped before its first step, or its host does not share --out)")
        return (f"rank {beat.rank} on {beat.host} (pid {beat.pid}) stopped answering: its "
                f"last heartbeat, {now - beat.changed:.0f} s old, said it {beat.what}")
    known = [beat for beat in seen.values() if beat.beat is not None]
    behind = min(known, key=lambda beat: (beat.progress, beat.rank))
    if all(beat.progress == behind.progress for beat in known):
        return None
    who = "this rank" if behind.rank == me else f"rank {behind.rank}"
    return (f"{who} on {behind.host} (pid {behind.pid}) is alive but behind: it last "
            f"{behind.what}, {now - behind.moved:.0f} s ago")


class Watchdog(Callback):
    """The heartbeat thread and the loop's progress, as a loop callback.

    Use as a context manager around the run: the thread starts on entry
    (when the run has more than one worker) and stops on exit, which
    removes this rank's heartbeat unless the run failed. Ranks are read from `distribution` at
    each beat, so an elastic run's renumbered ranks write their new files.

    Args:
        distribution: the run's distribution object (`rank`, `num_workers`).
        directory: str. The run's `--out`.
        timeout: float. `--collective-timeout`, seconds.
        interval: float. Seconds between beats; by default a tenth of the
            timeout, between 0.5 and 10.
        grace: float. Seconds past the timeout before a stalled rank ends;
            by default `grace_seconds(timeout)`.
    """

    def __init__(self, distribution, directory, timeout, interval=None, grace=None):
        self.distribution = distribution
        self.directory = os.path.join(directory, DIRECTORY)
        self.timeout = float(timeout)
        self.interval = interval or min(max(self.timeout / 10, 0.5), 10.0)
        self.grace = grace_seconds(self.timeout) if grace is None else float(grace)
        self._progress, self._what = None, "started"  # None: no step yet
        self._stepped = False  # a first step has ended: it traced the step
        self._moved = time.monotonic()
        self._beat = 0
        self._seen = {}
        self._stop = threading.Event()
        self._thread = None
        self._host, self._pid = socket.gethostname(), os.getpid()

    @classmethod
    def for_run(cls, distribution, directory):
        """The run's watchdog: its timeout is the distribution's
        `collective_timeout`; one that never starts without one."""
        timeout = getattr(distribution.options, "collective_timeout", None)
        return cls(distribution, directory, timeout or float("inf"))

    def __enter__(self):
        if self.distribution.num_workers > 1 and self.timeout < float("inf"):
            self._thread = threading.Thread(target=self._watch, name="tfgpt-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, error_type, error, traceback):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if error_type is None:  # a failed run's heartbeats say where each rank was
                try:
                    os.remove(self._path(self.distribution.rank))
                except OSError:
                    pass

    def on_step_begin(self, step):
        self._passed(3 * step, f"began step {step}")

    def on_step_end(self, step):
        self._passed(3 * step + 1, f"ended step {step}")
        self._stepped = True

    def on_save(self, step):
        self._passed(3 * step + 2, f"saved step {step}")

    def _passed(self, progress, what):
        self._progress, self._what, self._moved = progress, what, time.monotonic()

    def _path(self, rank):
        return os.path.join(self.directory, f"rank-{rank}.json")

    def _watch(self):
        while not self._stop.wait(self.interval):
            if self._progress is None:
                continue  # the start-up, before the loop: not watched
            rank, size = self.distribution.rank, self.distribution.num_workers
            self._beat += 1
            self._write(rank)
            now = time.monotonic()
            self._read(rank, size, now)
            stalled = now - self._moved
            if stalled >= self.timeout + self.grace:
                holding = holder(self._seen, rank, now, self.timeout)
                if holding or self._stepped:
                    self._end(rank, holding, stalled)

    def _record(self):
        return {"beat": self._beat, "progress": self._progress, "what": self._what,
                "host": self._host, "pid": self._pid}

    def _write(self, rank):
        record = self._record()
        try:
            os.makedirs(self.directory, exist_ok=True)
            partial = self._path(rank) + f".{self._pid}.tmp"
            with open(partial, "w") as file:
                json.dump(record, file)
            os.replace(partial, self._path(rank))
        except OSError:
            pass  # the others cannot see this rank; its own wait is still watched

    def _read(self, me, size, now):
        """Updates `_seen` for ranks 0 to `size - 1`: when each one's beat
        and progress last changed, by this rank's clock."""
        self._seen = {rank: beat for rank, beat in self._seen.items() if rank < size}
        for rank in range(size):
            if rank == me:  # its own beat is current; its own loop moved at _moved
                self._seen[rank] = Heartbeat(rank, **self._record(), changed=now,
                                             moved=self._moved)
                continue
            try:
                with open(self._path(rank)) as file:
                    record = json.load(file)
            except (OSError, ValueError):
                record = None
            last = self._seen.get(rank)
            if record is None:
                if last is None:
                    self._seen[rank] = Heartbeat(rank, None, None, "", "", 0, now, now)
                continue
            changed = now if last is None or last.beat != record["beat"] else last.changed
            moved = (now if last is None or last.progress != record["progress"]
                     else last.moved)
            self._seen[rank] = Heartbeat(rank, record["beat"], record["progress"],
                                         record["what"], record["host"], record["pid"],
                                         changed, moved)

    def _end(self, rank, holding, stalled):
        cause = holding or ("every rank waits in the same place (a deadlock, or a step "
                            "longer than the timeout)")
        print(f"error: rank {rank} on {self._host}: watchdog: {cause}; this rank "
              f"{self._what} {stalled:.0f} s ago and waited since (--collective-timeout "
              f"{self.timeout:g} s); ending this process", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(STATUS)
