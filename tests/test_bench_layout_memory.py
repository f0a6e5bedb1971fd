"""bench.layout_memory: real train_hvd.py runs under two layouts, each rank's peak reported."""

import json
import subprocess
import sys

import pytest

from tests.launch import REPO, train_losses

TINY_MODEL = ["--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
              "--intermediate-dim", "48", "--max-sequence-length", "16"]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_layouts_train_and_each_rank_reports_its_peak(tiny_data, tmp_path):
    rows_file = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.layout_memory", "--data", str(tiny_data),
         "--out", str(tmp_path / "runs"), "--json", str(rows_file),
         "--layout", "DP2=--batch-size 2",
         "--layout", "PP2=--batch-size 4 --pipeline-parallel 2 --microbatches 2",
         "--", *TINY_MODEL, "--steps", "2", "--eval-batches", "1", "--log-every", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(rows_file.read_text())
    assert [row["layout"] for row in rows] == ["DP2", "PP2"]
    for row in rows:
        # Each layout is a real run: its two steps logged, both ranks' peaks read.
        assert sorted(train_losses(tmp_path / "runs" / row["layout"] / "run")) == [1, 2]
        assert sorted(map(int, row["peaks"])) == [0, 1]
        assert all(peak > 2**20 for peak in row["peaks"].values())
    reference = max(rows[0]["peaks"].values())
    ratio = max(rows[1]["peaks"].values()) / reference
    assert "| PP2    |" in result.stdout and f"{ratio:.2f}" in result.stdout, result.stdout
