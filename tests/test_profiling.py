"""Trainer options for performance work: --profile-steps and --recompute."""

import glob
import json

import numpy as np
import pytest

from tfgpt.config import TrainConfig
from tfgpt.parallel import LocalDistribution
from tfgpt.training.flags import parse_flags

TINY = ["--num-layers", "2", "--num-heads", "2", "--hidden-dim", "16",
        "--intermediate-dim", "24", "--max-sequence-length", "16"]


def _train(argv):
    from tfgpt.training.trainer import train

    train_config, overrides = parse_flags(argv)
    return train(train_config, overrides, LocalDistribution())


@pytest.mark.parametrize("value", ["3", "0,2", "4,2", "a,b", "1,2,3"])
def test_bad_profile_steps_are_refused(value):
    with pytest.raises(ValueError, match=r"`profile_steps` must be START,END.*" + value):
        TrainConfig(data="d", profile_steps=value)


def test_profile_steps_write_a_trace_of_those_steps(tiny_data, tmp_path):
    from bench import profile_summary

    _train(["--data", str(tiny_data), "--out", str(tmp_path), "--steps", "5", "--log-every", "5",
            "--batch-size", "4", "--eval-batches", "1", "--peak-flops", "1e10",
            "--profile-steps", "2,3", "--recompute", *TINY])
    traces = glob.glob(str(tmp_path / "profile" / "**" / "*.xplane.pb"), recursive=True)
    assert len(traces) == 1
    totals = profile_summary.summarize(str(tmp_path / "profile"))
    assert any("MatMul" in kind for kind in totals)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["train"]["recompute"] is True and "recompute" not in config["model"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite([r["loss"] for r in records if r["split"] == "train"]).all()
