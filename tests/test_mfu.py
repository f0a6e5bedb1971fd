"""MFU against the peak the worker really reaches: never above 1.

MFU divides the model's FLOP/s by `flops.measure_matmul_peak`. With two
towers each op runs on one of two threads, so a peak measured with one
chain of matmuls saw one thread while the step used two, and gpt-mini read
MFU 1.74 on 2 cores. The peak now runs one chain per tower side by side.
"""

import json
import sys

import pytest

from tests.launch import REPO, run
from tests.synthetic import pattern_corpus
from tfgpt.training import flops


@pytest.mark.slow
def test_train_hvd_with_two_towers_logs_mfu_within_one(tmp_path):
    from pipelines import prepare

    pattern_corpus(tmp_path / "corpus.txt", documents=800)
    data = tmp_path / "data"
    code = prepare.main([
        "--input", str(tmp_path / "corpus.txt"), "--output", str(data),
        "--seq-len", "64", "--vocab-size", "300", "--val-fraction", "0.1",
    ])
    assert code == 0
    run_dir = tmp_path / "run"
    # gpt-mini's matmuls (hidden 384, 1536) reach most of the peak: a peak
    # measured on one tower's threads makes this run read MFU above 1.
    code, output = run([
        sys.executable, REPO / "train_hvd.py", "--data", data, "--out", run_dir,
        "--preset", "gpt-mini", "--max-sequence-length", "64", "--batch-size", "8",
        "--towers", "2", "--steps", "12", "--log-every", "2", "--eval-batches", "0",
    ])
    assert code == 0, output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mfus = [record["mfu"] for record in records if "mfu" in record]
    assert len(mfus) >= 5, records
    assert all(0 < mfu <= 1 for mfu in mfus), (mfus, output)
    # The start-up line names the fused kernels the dispatch table gives a
    # float32 GPT step without dropout (the library is built by make setup).
    from tfgpt import kernels

    expected = kernels.summary("float32", xla=False, dropout=0.0, masked=False, strategy=False)
    assert expected.startswith("fused kernels: attention"), expected
    assert expected in output.splitlines(), output


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(towers=0), "towers=0"),
        (dict(towers=True), "towers=True"),
        (dict(sizes=()), r"sizes=\(\)"),
        (dict(sizes=(64, -1)), r"sizes=\(64, -1\)"),
    ],
)
def test_bad_peak_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        flops.measure_matmul_peak("float32", seconds=0.01, **arguments)

