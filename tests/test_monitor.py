"""The time split of each logging window (tfgpt.observe.monitor): measured, per worker.

Faults are injected and the share they should move is checked: a reader
slowed by a sleep (data), one Horovod rank's forward pass slowed by a sleep
(that rank's compute, the other rank's wait for the averaged gradients).
"""

import contextlib
import glob
import io
import json
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.launch import REPO, horovodrun
from tfgpt.observe import monitor
from tfgpt.parallel import LocalDistribution

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
    assert 0 < shares["compute"] <= 0.4  # 0.04 s of at least 0.1 s (slept), however loaded
    clock.reset()
    assert clock.shares()["other"] == pytest.approx(1.0)


def test_one_worker_gathers_its_own_row_and_the_host_figures():
    clock = monitor.WindowClock()
    clock.add("data", 0.0)
    means, rows = monitor.window_figures(LocalDistribution(), clock, monitor.HostSampler())
    assert [row["rank"] for row in rows] == [0]
    # No GPU here: its columns are left out.
    assert set(rows[0]) == {"rank", *monitor.COLUMNS} - {"gpu_percent", "gpu_memory_mib"}
    assert means == {f"time_{part}": pytest.approx(rows[0][part]) for part in monitor.SHARES}
    import psutil

    assert rows[0]["rss_mib"] == pytest.approx(psutil.Process().memory_info().rss / 2**20, rel=0.2)


def test_a_gpu_is_sampled_through_nvml_and_judged_by_its_utilisation(monkeypatch):
    class FakeNvml:
        @staticmethod
        def nvmlDeviceGetUtilizationRates(handle):
            return type("Rates", (), {"gpu": 30})

        @staticmethod
        def nvmlDeviceGetMemoryInfo(handle):
            return type("Memory", (), {"used": 3 * 2**30})

    monkeypatch.setattr(monitor, "_nvml_device", lambda index: (FakeNvml, f"gpu{index}"))
    _, rows = monitor.window_figures(LocalDistribution(), monitor.WindowClock(),
                                     monitor.HostSampler(gpu_index=0))
    assert rows[0]["gpu_percent"] == 30 and rows[0]["gpu_memory_mib"] == 3072
    rules = monitor.Rules(["a"])
    ((rule, message),) = [fired for fired in rules.check(10, {}, [{**rows[0], "cpu_percent": 99}])
                          if fired[0] == "low-utilisation"]
    assert "rank 0 on a's GPU was busy 30% of the time" in message


def test_reporter_puts_details_in_json_only_and_the_shares_in_one_console_field(tmp_path):
    from tfgpt.observe.reporter import Reporter

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


def test_reporter_writes_every_workers_figures_to_tensorboard(tmp_path):
    from tfgpt.observe.reporter import Reporter

    report = Reporter(str(tmp_path), True, stream=io.StringIO())
    report.scalars(5, {"loss": 2.0}, details={"workers": [
        {"rank": 0, "compute": 0.7, "rss_mib": 1200.0},
        {"rank": 1, "compute": 0.4, "rss_mib": 900.0},
    ]})
    report.close()
    values = {}
    for path in glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                values[(event.step, value.tag)] = float(tf.make_ndarray(value.tensor))
    assert values == pytest.approx({
        (5, "train/loss"): 2.0,
        (5, "train/worker_0/compute"): 0.7, (5, "train/worker_0/rss_mib"): 1200.0,
        (5, "train/worker_1/compute"): 0.4, (5, "train/worker_1/rss_mib"): 900.0,
    })


def _row(rank, data=0.01, compute=0.9, communication=0.05, cpu_percent=95.0, rss_mib=1000.0):
    return {"rank": rank, "data": data, "compute": compute, "communication": communication,
            "other": 1 - data - compute - communication, "cpu_percent": cpu_percent,
            "rss_mib": rss_mib, "iowait_percent": 0.0}


def _windows(rules, windows, loss=lambda index: 5.0 - 0.1 * index, norm=lambda index: 1.0):
    """Feeds `windows` (a list of row lists) to `rules`; returns [(window, rule, message)]."""
    fired = []
    for index, rows in enumerate(windows):
        for rule, message in rules.check(10 * (index + 1), {"loss": loss(index),
                                                            "gradient_norm": norm(index)}, rows):
            fired.append((index, rule, message))
    return fired


def test_a_healthy_run_fires_no_rule():
    rules = monitor.Rules(["a", "b"])
    healthy = [[_row(0, rss_mib=1000 + (index % 2)), _row(1, compute=0.88)] for index in range(30)]
    assert _windows(rules, healthy) == []


@pytest.mark.parametrize("fault, rule, window, named", [
    # Rank 1 waits for data 30% of the window from the third window on.
    (lambda index, rank: {"data": 0.3, "compute": 0.6} if rank == 1 and index >= 2 else {},
     "input-bound", 2, "rank 1 on b"),
    # Rank 1 computes 1.5 times as long as rank 0, which waits; the third window names it.
    (lambda index, rank: {"compute": 0.95, "communication": 0.0} if rank == 1 else
     {"compute": 0.5, "communication": 0.45}, "straggler", 2, "rank 1 on b"),
    # Both ranks wait for the average 40% of the time.
    (lambda index, rank: {"compute": 0.5, "communication": 0.4} if index >= 4 else {},
     "communication-bound", 4, None),
    # Rank 0 idles from the sixth window.
    (lambda index, rank: {"cpu_percent": 20.0} if rank == 0 and index >= 5 else {},
     "low-utilisation", 5, "rank 0 on a"),
    # Rank 1's resident set grows by 10 MiB every window: the fifth growth names it.
    (lambda index, rank: {"rss_mib": 1000.0 + 10 * index} if rank == 1 else {},
     "memory-growth", 5, "rank 1 on b"),
])
def test_each_fault_fires_its_rule_once_at_the_right_window_and_worker(fault, rule, window, named):
    rules = monitor.Rules(["a", "b"])
    windows = [[_row(rank, **fault(index, rank)) for rank in (0, 1)] for index in range(12)]
    fired = _windows(rules, windows)
    assert [(index, name) for index, name, _ in fired if name == rule] == [(window, rule)]
    message = next(message for _, name, message in fired if name == rule)
    assert message.startswith(f"{rule} at step {10 * (window + 1)}: ")
    if named:
        assert named in message
    # The straggler's peers wait, but not all workers do: no communication rule.
    assert "communication-bound" not in {name for _, name, _ in fired} or rule == \
        "communication-bound"


@pytest.mark.parametrize("pipeline, names, remedy", [
    (False, "the averaged gradients", "--fp16-allreduce"),
    (True, "the pipeline's transfers and bubble", "Raise --microbatches"),
])
def test_communication_bound_names_the_pipelines_wait_in_a_pipeline_run(pipeline, names, remedy):
    rules = monitor.Rules(["a", "b"], pipeline=pipeline)
    waiting = [[_row(rank, compute=0.5, communication=0.4) for rank in (0, 1)]]
    ((_, rule, message),) = _windows(rules, waiting)
    assert rule == "communication-bound"
    assert f"waited for {names} more than 40% of the time (over 25%)" in message
    assert remedy in message and ("--fp16-allreduce" in message) != pipeline


def test_a_loss_that_stops_falling_and_a_gradient_spike():
    rules = monitor.Rules(["a"])
    rows = [[_row(0)] for _ in range(30)]
    # Falls for 8 windows, then flat: the 10th flat window has no new minimum.
    fired = _windows(rules, rows, loss=lambda index: 5.0 - 0.1 * min(index, 7),
                     norm=lambda index: 40.0 if index == 20 else 1.0 + 0.01 * index)
    assert [(index, name) for index, name, _ in fired] == [
        (17, "loss-not-falling"), (20, "gradient-spike")]
    assert "gradient norm 40 is" in fired[1][2]


def _last_window(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if record["split"] == "train"][-1]


def _train_in_process(data, out, monkeypatch, reader_sleep, steps=12, log_every=6,
                      callbacks=()):
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
    # A model whose step (tens of milliseconds) outweighs reading a batch.
    config, overrides = parse_flags(
        ["--data", str(data), "--out", str(out), "--steps", str(steps),
         "--log-every", str(log_every),
         "--batch-size", "16", "--eval-batches", "1", "--peak-flops", "1e10", "--towers", "1",
         "--num-layers", "2", "--num-heads", "4", "--hidden-dim", "256",
         "--intermediate-dim", "1024", "--max-sequence-length", "16"]
    )
    trainer.train(config, overrides, LocalDistribution(), callbacks)
    return _last_window(out)


def test_a_slow_reader_shows_as_data_time(tiny_data, tmp_path, monkeypatch):
    healthy = _train_in_process(tiny_data, tmp_path / "healthy", monkeypatch, 0)
    slow = _train_in_process(tiny_data, tmp_path / "slow", monkeypatch, 0.5)
    for window in (healthy, slow):
        shares = [window[f"time_{part}"] for part in monitor.SHARES]
        assert all(share >= 0 for share in shares) and sum(shares) == pytest.approx(1.0)
        assert window["workers"][0]["rank"] == 0 and window["workers"][0]["cpu_percent"] >= 0
    assert healthy["time_compute"] > 0.1  # the step's own timestamps
    # 0.5 s per batch against a step of tens of milliseconds.
    assert slow["time_data"] > 0.7
    assert slow["time_data"] > healthy["time_data"] + 0.4
    fired = {}
    for run in ("healthy", "slow"):
        records = [json.loads(line)
                   for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        fired[run] = {entry["rule"]: record["step"] for record in records
                      for entry in record.get("rules", [])}
    # Windows at steps 1 (start-up, not judged), 6 and 12: the second names it.
    assert fired["slow"]["input-bound"] == 6
    assert "input-bound" not in fired["healthy"], fired


def test_memory_kept_every_step_fires_memory_growth(tiny_data, tmp_path, monkeypatch):
    from tfgpt.resilience.faults import FaultInjection

    grow = FaultInjection(LocalDistribution(), grow_mib="0:8")  # rank 0 keeps 8 MiB a step
    window = _train_in_process(tiny_data, tmp_path / "run", monkeypatch, 0, steps=14,
                               log_every=2, callbacks=[grow])
    records = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    rss = [r["workers"][0]["rss_mib"] for r in train]
    # 16 MiB more every window of 2 steps.
    assert all(later - earlier > 12 for earlier, later in zip(rss[1:], rss[2:])), rss
    fired = {entry["rule"]: record["step"] for record in records
             for entry in record.get("rules", [])}
    # Judged from step 2 on: it grew at steps 4, 6, 8, 10 and 12, the fifth in a row.
    assert fired.get("memory-growth") == 12, fired
    assert window["workers"][0]["rank"] == 0


@pytest.mark.distributed
def test_a_slow_rank_computes_longer_and_the_other_waits_for_the_average(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--data", tiny_data, "--out", run_dir, "--steps", "10", "--batch-size", "4",
             "--log-every", "2", "--eval-batches", "1", "--peak-flops", "1e10", *TINY_MODEL]
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
    # Windows at steps 2, 4, 6 (the first, step 1, is start-up): the third names rank 1.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fired = {entry["rule"]: record["step"] for record in records
             for entry in record.get("rules", [])}
    assert fired["straggler"] == 6, fired
    assert "communication-bound" not in fired
    (line,) = [line for line in output.splitlines() if "warning: straggler" in line]
    assert "rank 1 on " in line

    # The run's summary says the same, from the run directory alone.
    from tfgpt import report

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert report.main([str(run_dir)]) == 0
    text = printed.getvalue()
    train = [r for r in records if r["split"] == "train"]
    assert f"loss {train[0]['loss']:.4f} at step 1 -> {train[-1]['loss']:.4f} at step 10" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| 0 ") or line.startswith("| 1 ")}
    assert set(rows) == {"0", "1"}
    # Rank 1's compute share, the mean of the windows after the first.
    compute = np.mean([r["workers"][1]["compute"] for r in train[1:]])
    assert f"| {compute:.1%} |" in rows["1"]
    assert "step 6: straggler at step 6: rank 1 on " in text
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content, message", [
    (None, "has no metrics.jsonl"),
    ('{"step": 1, "split": "train", "loss": 2.0}\nnot json\n', "metrics.jsonl:2: not JSON"),
    ('{"step": 5, "split": "val", "loss": 2.0}\n', "no training window"),
])
def test_report_refuses_what_is_not_a_run_with_one_line(tmp_path, capsys, content, message):
    from tfgpt import report

    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path), "--no-plot"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
