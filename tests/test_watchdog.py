"""The watchdog of ranks that stop taking part (`tfgpt.resilience.watchdog`),
in one process: two ranks' watchdogs sharing a heartbeat directory, and its
judgement of which rank holds a run up on heartbeats written by hand.
The runs where a real rank stops or hangs: tests/test_peer_death.py."""

import threading
import time

import pytest

from tfgpt.resilience.watchdog import Heartbeat, Watchdog, holder


def beat(rank, progress, changed=100.0, moved=100.0, beats=7):
    return Heartbeat(rank, beats, progress, f"was at {progress}", f"host{rank}", 1000 + rank,
                     changed, moved)


@pytest.mark.parametrize("seen, me, expected", [
    # Alive and in the same place: nobody.
    ({0: beat(0, 9), 1: beat(1, 9)}, 0, None),
    # A heartbeat that stopped changing 20 s ago, at a timeout of 10 s.
    ({0: beat(0, 9), 1: beat(1, 9, changed=80.0)}, 0,
     "rank 1 on host1 (pid 1001) stopped answering: its last heartbeat, 20 s old, said it was at 9"),
    # Alive but behind the others, named by them and by itself.
    ({0: beat(0, 9), 1: beat(1, 8, moved=70.0), 2: beat(2, 9)}, 0,
     "rank 1 on host1 (pid 1001) is alive but behind: it last was at 8, 30 s ago"),
    ({0: beat(0, 9), 1: beat(1, 8, moved=70.0)}, 1,
     "this rank on host1 (pid 1001) is alive but behind: it last was at 8, 30 s ago"),
    # A stopped rank is named before one that is behind.
    ({0: beat(0, 9), 1: beat(1, 8), 2: beat(2, 9, changed=85.0)}, 0,
     "rank 2 on host2 (pid 1002) stopped answering: its last heartbeat, 15 s old, said it was at 9"),
    # A rank never seen.
    ({0: beat(0, 9), 1: Heartbeat(1, None, None, "", "", 0, 88.0, 88.0)}, 0,
     "rank 1 wrote no heartbeat in 12 s (it stopped before its first step, or its host does "
     "not share --out)"),
])
def test_the_rank_that_holds_the_run_up_is_named(seen, me, expected):
    assert holder(seen, me, now=100.0, timeout=10.0) == expected


class _Rank:
    def __init__(self, rank):
        self.rank, self.num_workers, self.options = rank, 2, None


class _Recorded(Watchdog):
    """A watchdog that records the line it would end its process with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ended = threading.Event()
        self.line = None

    def _end(self, rank, holding, stalled):
        self.line = (rank, holding, stalled)
        self.ended.set()
        self._stop.set()


def _pair(tmp_path, timeout):
    return [_Recorded(_Rank(rank), str(tmp_path), timeout, interval=0.05, grace=0.3)
            for rank in (0, 1)]


def test_steps_that_go_on_never_trip_it_and_a_clean_exit_removes_the_heartbeats(tmp_path):
    pair = _pair(tmp_path, timeout=0.5)
    with pair[0], pair[1]:
        for step in range(1, 16):  # 1.5 s in all, each step 0.1 s: under the timeout
            for watchdog in pair:
                watchdog.on_step_begin(step)
            time.sleep(0.1)
            for watchdog in pair:
                watchdog.on_step_end(step)
        assert sorted(path.name for path in (tmp_path / ".heartbeats").iterdir()) == [
            "rank-0.json", "rank-1.json"]
    assert not any(watchdog.ended.is_set() for watchdog in pair)
    assert not list((tmp_path / ".heartbeats").iterdir())


def test_a_stopped_peer_is_named_once_the_timeout_has_passed(tmp_path):
    first, second = _pair(tmp_path, timeout=0.5)
    with first, second:
        for watchdog in (first, second):
            watchdog.on_step_begin(1)
        while not (tmp_path / ".heartbeats" / "rank-1.json").exists():
            time.sleep(0.01)
        second._stop.set()  # rank 1 stops: no more heartbeats
        assert first.ended.wait(5.0)
    rank, holding, stalled = first.line
    assert rank == 0 and holding.startswith("rank 1 on ") and "stopped answering" in holding
    assert holding.endswith("said it began step 1") and stalled >= 0.5


def test_a_rank_behind_the_others_is_named_by_both(tmp_path):
    first, second = _pair(tmp_path, timeout=0.5)
    with first, second:
        for watchdog in (first, second):
            watchdog.on_step_begin(1)
            watchdog.on_step_end(1)
        first.on_step_begin(2)  # rank 1 never begins step 2, and its thread runs on
        assert first.ended.wait(5.0) and second.ended.wait(5.0)
    for watchdog in (first, second):
        assert "on " in watchdog.line[1] and "is alive but behind: it last ended step 1" in (
            watchdog.line[1])
    assert first.line[1].startswith("rank 1 on ")
    assert second.line[1].startswith("this rank on ")


def test_a_long_first_step_that_every_rank_is_in_is_waited_out_and_a_later_one_is_not(
        tmp_path):
    first, second = _pair(tmp_path, timeout=0.5)
    with first, second:
        for watchdog in (first, second):
            watchdog.on_step_begin(1)  # both alive and tracing, past timeout and grace
        assert not first.ended.wait(2.0) and not second.ended.is_set()
        for watchdog in (first, second):
            watchdog.on_step_end(1)
            watchdog.on_step_begin(2)
        assert first.ended.wait(5.0) and second.ended.wait(5.0)
    for watchdog in (first, second):
        assert watchdog.line[1] is None  # every rank waits in the same place
        assert watchdog.line[2] >= 0.5 + 0.3


def test_the_module_example_holds():
    import doctest

    from tfgpt.resilience import watchdog

    assert doctest.testmod(watchdog).attempted and not doctest.testmod(watchdog).failed
