"""The time split of each logging window (tfgpt.training.monitor): measured, per worker.

Faults are injected and the share they should move is checked: a reader
slowed by a sleep (data), one Horovod rank's forward pass slowed by a sleep
(that rank's compute, the other rank's wait for the averaged gradients).
"""

import io
import json
import time

import numpy as np
import pytest

from tests.launch import REPO, horovodrun
from tfgpt.distributed import LocalDistribution
from tfgpt.training import monitor

TINY_MODEL = [
    "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]


def test_window_shares_are_each_parts_seconds_over_the_wall_time():
    clock = monitor.WindowClock()
    clock.add("data", 0.02)
    clock.add_step_times(np.array([0.04, 0.01]))
    clock.add_step_times(None)  # a step without timestamps (XLA) adds nothing
    time.sleep(0.1)
    shares = clock.shares()
    assert set(shares) == set(monitor.SHARES)
    assert sum(shares.values()) == pytest.approx(1.0)
    # Every part is divided by the same wall time.
    assert shares["compute"] / shares["data"] == pytest.approx(2.0)
    assert shares["compute"] / shares["communication"] == pytest.approx(4.0)
    assert 0.3 < shares["compute"] < 0.41  # 0.04 s of at least 0.1 s
    clock.reset()
    assert clock.shares()["other"] == pytest.approx(1.0)


def test_one_worker_gathers_its_own_row_and_the_host_figures():
    clock = monitor.WindowClock()
    clock.add("data", 0.0)
    means, rows = monitor.window_figures(LocalDistribution(), clock, monitor.HostSampler())
    assert [row["rank"] for row in rows] == [0]
    assert set(rows[0]) == {"rank", *monitor.COLUMNS}
    assert means == {f"time_{part}": pytest.approx(rows[0][part]) for part in monitor.SHARES}
    import psutil

    assert rows[0]["rss_mib"] == pytest.approx(psutil.Process().memory_info().rss / 2**20, rel=0.2)


def test_reporter_puts_details_in_json_only_and_the_shares_in_one_console_field(tmp_path):
    from tfgpt.training.reporter import Reporter

    stream = io.StringIO()
    report = Reporter(str(tmp_path), True, stream=stream)
    report.scalars(5, {"loss": 2.0, "time_data": 0.1, "time_compute": 0.7,
                       "time_communication": 0.15, "time_other": 0.05},
                   details={"workers": [{"rank": 0, "data": 0.1}]})
    report.close()
    line = stream.getvalue().strip()
    assert line == ("train step      5 | loss 2.0000 | "
                    "time data/compute/communication/other 10/70/15/5%")
    (record,) = [json.loads(text) for text in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["workers"] == [{"rank": 0, "data": 0.1}]
    assert record["time_compute"] == 0.7


def _last_window(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if record["split"] == "train"][-1]


def _train_in_process(data, out, monkeypatch, reader_sleep):
    from tfgpt.training import trainer
    from tfgpt.training.flags import parse_flags

    if reader_sleep:
        wrapped = trainer.batches_naming_bad_shards

        def slow(dataset, data_dir, split):
            for batch in wrapped(dataset, data_dir, split):
                if split == "train":
                    time.sleep(reader_sleep)
                yield batch

        monkeypatch.setattr(trainer, "batches_naming_bad_shards", slow)
    config, overrides = parse_flags(
        ["--data", str(data), "--out", str(out), "--steps", "12", "--log-every", "6",
         "--batch-size", "4", "--eval-batches", "1", "--peak-flops", "1e10", "--towers", "1",
         *TINY_MODEL]
    )
    trainer.train(config, overrides, LocalDistribution())
    return _last_window(out)


def test_a_slow_reader_shows_as_data_time(tiny_data, tmp_path, monkeypatch):
    healthy = _train_in_process(tiny_data, tmp_path / "healthy", monkeypatch, 0)
    slow = _train_in_process(tiny_data, tmp_path / "slow", monkeypatch, 0.1)
    for window in (healthy, slow):
        shares = [window[f"time_{part}"] for part in monitor.SHARES]
        assert all(share >= 0 for share in shares) and sum(shares) == pytest.approx(1.0)
        assert window["workers"][0]["rank"] == 0 and window["workers"][0]["cpu_percent"] >= 0
    assert healthy["time_compute"] > 0.1  # the step's own timestamps
    # 0.1 s per batch against a step of a few milliseconds.
    assert slow["time_data"] > 0.7
    assert slow["time_data"] > healthy["time_data"] + 0.4


@pytest.mark.distributed
def test_a_slow_rank_computes_longer_and_the_other_waits_for_the_average(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--data", tiny_data, "--out", run_dir, "--steps", "8", "--batch-size", "4",
             "--log-every", "4", "--eval-batches", "1", "--peak-flops", "1e10", *TINY_MODEL]
    code, output = horovodrun(2, REPO / "train_hvd.py", *flags,
                              env={"TFGPT_FAULT_SLOW_COMPUTE": "1:0.2"})
    assert code == 0, output
    window = _last_window(run_dir)
    fast, slow = window["workers"]
    assert (fast["rank"], slow["rank"]) == (0, 1)
    # Rank 1 spends 0.2 s of each step in its forward pass; rank 0, done in
    # milliseconds, spends that time waiting for the allreduce.
    assert slow["compute"] > 0.6 and fast["compute"] < 0.3
    assert fast["communication"] > 0.6 and slow["communication"] < 0.3
    assert "time data/compute/communication/other" in output
