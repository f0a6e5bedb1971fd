"""bench.scaling --zero-stages: the order of the runs and the ratios it reports."""

import pytest

from bench import scaling


def test_stages_alternate_and_ratios_are_per_round(monkeypatch, tmp_path):
    calls = []
    # Stage 0 slows down in the second round (the machine got busier): the
    # ratios are taken within each round, so stage 2 stays at 0.9 of it.
    rates = {(0, 0): 1000.0, (0, 1): 500.0, (2, 0): 900.0, (2, 1): 450.0,
             (3, 0): 800.0, (3, 1): 300.0}

    def fake_run_job(kind, workers, data, work, preset, steps, batch_size, log_every, extra,
                     label=""):
        stage = int(extra[extra.index("--zero-stage") + 1])
        round_index = sum(1 for call in calls if call[1] == stage)
        calls.append((kind, stage, workers, tuple(extra), label))
        return rates[stage, round_index], 4, {}

    monkeypatch.setattr(scaling, "run_job", fake_run_job)
    figures = scaling.measure_zero("data", str(tmp_path), [0, 2, 3], rounds=2,
                                   extra=["--recompute"], log=lambda line: None)
    assert [stage for _, stage, *_ in calls] == [0, 2, 3, 3, 2, 0]
    assert all(kind == "horovod" and workers == 2 and extra[0] == "--recompute"
               for kind, _, workers, extra, _ in calls)
    assert len({label for *_, label in calls}) == 3  # one run directory per stage
    results = figures["results"]
    assert results[0]["median"] == pytest.approx(750.0)
    assert results[2]["ratio_per_round"] == pytest.approx([0.9, 0.9])
    assert results[2]["ratio_to_stage_0"] == pytest.approx(0.9)
    assert results[3]["ratio_per_round"] == pytest.approx([0.8, 0.6])
    assert results[3]["ratio_to_stage_0"] == pytest.approx(0.7)


def test_without_stage_0_there_are_no_ratios(monkeypatch, tmp_path):
    monkeypatch.setattr(scaling, "run_job", lambda *args, **kwargs: (100.0, 3, {}))
    figures = scaling.measure_zero("data", str(tmp_path), [1, 2], log=lambda line: None)
    assert all("ratio_to_stage_0" not in result for result in figures["results"].values())
    assert figures["results"][1]["median"] == 100.0


def test_zero_stages_refuse_kinds_and_baseline():
    for argv in (["--zero-stages", "0", "1", "--kinds", "independent"],
                 ["--zero-stages", "0", "--baseline", "elsewhere"]):
        with pytest.raises(SystemExit) as raised:
            scaling.main(argv)
        assert raised.value.code == 2
