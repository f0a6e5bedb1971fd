"""Every decoder family, in each layout, in float32 and under bfloat16 and float16,
trains as one process does.

Each family's demo preset, shrunk by flags to a tiny shape (2 blocks, 4
heads, width 32), trains for 3 steps on one global order of the records
(`--global-order`) in global batches of 8 sequences, without dropout and
with global-norm clipping (which acts: the norms are above 1), through
the real trainer (`tests/hvd_scripts/layout_train.py`): once in one
process, the oracle, in each precision, and in each layout of `MATRIX`,
all of them in one launch per rank count (one process, `horovodrun -np 2`):

    ZeRO-3 (4 sequences per rank): GPT-2, Llama, GPT-J, GPT-Neo and Pythia under
        bfloat16 and float16 (its dynamic loss scaling); Mistral and Qwen2 in float32
    TP2 (the tensor group reads the whole batch): as ZeRO-3
    PP2, 1F1B over 2 micro-batches (one block per stage): GPT-J, Pythia: bfloat16 and
        float16; Mistral, Qwen2 and GPT-Neo: float32
    ZeRO-1, and ZeRO-2 with `--recompute` (4 sequences per rank): GPT-J, GPT-Neo,
        Pythia, Mistral and Qwen2 in float32

The families: GPT-2, Llama (grouped-query attention: 4 query heads share 2
key-value heads), Mistral (Llama's with a sliding window of 4 tokens in
every block, shorter than the 16-token records), Qwen2 (Llama's with biases
on the queries, keys and values, and a tied head), GPT-J (interleaved
rotary positions on half of each head, a parallel residual, a head bias),
GPT-Neo (local attention of 4 tokens in every second block) and
GPT-NeoX/Pythia (rotary on a quarter of each head, two norms in parallel).
GPT-2 and Llama take ZeRO-1 and 2, 3D and `--recompute` in float32 in
tests/test_zero.py, tests/test_three_d.py, tests/test_zero_groups.py and
tests/test_resume_layouts.py; GPT-J- and Qwen2-shaped models take TP2 x PP2
with `--recompute` on 4 ranks in tests/test_three_d.py (a launch of 4
ranks here, over the five families, cost about 75 s of CPU).

In float32 a layout only reorders the sums: each step's loss within 1e-5
of the oracle's, its gradient norm within 1e-5 relative, each weight within
1e-5.

What a layout changes under a mixed precision is where the 16-bit values
are rounded (which sums are split across ranks or micro-batches, in which
order they are added), not what is computed. The bounds, by the
precision's unit roundoff u (2^-9 for bfloat16's 8 significant bits,
2^-11 for float16's 11):

- each step's loss within u of the oracle's, relative: it is a float32
  mean over 128 tokens of logits each rounded about once more or less;
- each step's gradient norm (before clipping) within 4u: each gradient
  comes through a chain of roundings, about two per block of the backward pass;
- float16: the same loss scale and skipped steps at each step;
- each variable that several ranks hold whole (a tensor group's
  replicated norms and biases, the tied table on both pipeline ends,
  ZeRO-3's gathered weights) bitwise the same on each of them, and the
  whole model, its slices joined, within `WEIGHT_TOLERANCE` of how far the
  oracle's training moved it (norms over all the weights): AdamW's first
  steps move every weight by about the learning rate whatever the size of
  its gradient, so a weight whose gradient is near 0 may move the other way.

Measured on a 2-core AMD EPYC (family 26, with AVX512_BF16): the layouts'
losses agree to 5e-5 relative, their norms to 2.1e-3 (bfloat16) and
6.7e-4 (float16), their weights to 0.046 of the movement; one process in
float32 against one in bfloat16 differs as much (0.032). A learning rate
10% higher than the oracle's moves the loss at step 3 by 3.5e-3 and the
weights by 0.10 of the movement: beyond both bounds. The oracle's loss is
finite and falls by more than 0.1 nats.

PP2 of GPT-2, Llama and GPT-Neo under bfloat16 and float16 is left out:
their blocks are sequential, and their PP2 runs logged the oracle's losses
and norms bit for bit (a stage rounds as one process does), so they checked
no rounding that the families with parallel residuals (GPT-J, Pythia) do not;
what a pipeline does under float16 (the scaled loss through the stages, a
step every stage skips) is tests/test_pipeline.py's, and those three
families' pipelines in float32 are tests/test_resume_layouts.py's (Llama),
tests/test_pipeline.py's (GPT-2) and PP2 here (GPT-Neo: its second block,
the windowed one, is the second stage's first).
"""

import json

import numpy as np
import pytest

from tests.launch import REPO, launch_each
from tfgpt.parallel.tensor_parallel import join_slices

SCRIPT = REPO / "tests" / "hvd_scripts" / "layout_train.py"
STEPS = 3
FLAGS = [
    "--steps", STEPS, "--log-every", "1", "--dropout", "0.0", "--eval-batches", "1",
    "--peak-flops", "1e11", "--learning-rate", "3e-3", "--warmup-steps", "1",
    "--no-scale-learning-rate", "--global-order", "--gradient-clip-norm", "1.0",
    "--num-layers", "2", "--num-heads", "4", "--hidden-dim", "32", "--intermediate-dim", "48",
    "--max-sequence-length", "16",
]
FAMILIES = {
    "gpt2": ["--preset", "gpt-demo"],
    "llama": ["--preset", "llama-demo"],  # 2 key-value heads
    "mistral": ["--preset", "mistral-demo", "--sliding-window", "4"],  # 2 key-value heads
    "qwen2": ["--preset", "qwen2-demo"],  # 2 key-value heads, query/key/value biases
    "gptj": ["--preset", "gptj-demo", "--rotary-fraction", "0.5"],
    "gpt-neo": ["--preset", "gpt-neo-demo", "--sliding-window", "4"],
    "pythia": ["--preset", "pythia-demo"],
}
# Unit roundoff; float32's bounds are absolute and fixed (`FLOAT32_TOLERANCE`).
PRECISIONS = {"float32": None, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -11}
FLOAT32_TOLERANCE = 1e-5
PIPELINE = ["--pipeline-parallel", "2", "--microbatches", "2"]
# name: (ranks, tensor slices, flags); 8 sequences per step in every layout.
LAYOUTS = {
    "one": (1, 1, ["--batch-size", "8"]),
    "zero1": (2, 1, ["--batch-size", "4", "--zero-stage", "1"]),
    "zero2-recompute": (2, 1, ["--batch-size", "4", "--zero-stage", "2", "--recompute"]),
    "zero3": (2, 1, ["--batch-size", "4", "--zero-stage", "3"]),
    "tp2": (2, 2, ["--batch-size", "8", "--tensor-parallel", "2"]),
    "pp2": (2, 1, ["--batch-size", "8", *PIPELINE]),
}
MIXED = ("bfloat16", "float16")
MIXED_FAMILIES = ("gpt2", "llama", "gptj", "gpt-neo", "pythia")
NEWER = ("mistral", "qwen2", "gptj", "gpt-neo", "pythia")  # GPT-2's and Llama's: elsewhere
# (layout, families, precisions): the runs besides the oracles.
MATRIX = [
    ("zero3", MIXED_FAMILIES, MIXED),
    ("tp2", MIXED_FAMILIES, MIXED),
    ("pp2", ("gptj", "pythia"), MIXED),
    ("zero1", NEWER, ("float32",)),
    ("zero2-recompute", NEWER, ("float32",)),
    ("zero3", ("mistral", "qwen2"), ("float32",)),
    ("tp2", ("mistral", "qwen2"), ("float32",)),
    ("pp2", ("mistral", "qwen2", "gpt-neo"), ("float32",)),
]
# |layout's weights - oracle's| / |oracle's weights - initial weights|, over the whole model.
WEIGHT_TOLERANCE = 0.08


def _tag(layout, family, precision):
    return f"{layout}-{family}-{precision}"


def _runs():
    """`[(layout, family, precision)]`: every run of `MATRIX` and the oracle of each
    family and precision it has."""
    runs = [(layout, family, precision) for layout, families, precisions in MATRIX
            for family in families for precision in precisions]
    oracles = sorted({("one", family, precision) for _, family, precision in runs},
                     key=lambda run: (list(FAMILIES).index(run[1]), run[2]))
    return oracles + runs


@pytest.fixture(scope="module")
def layout_runs(tiny_data, tmp_path_factory):
    """Every run of `_runs()` trained: one launch per rank count. Returns the runs' directory."""
    directory = tmp_path_factory.mktemp("layouts")
    runs = _runs()
    for ranks in sorted({LAYOUTS[layout][0] for layout, _, _ in runs}):
        launch_each(SCRIPT, 0 if ranks == 1 else ranks, [
            [directory, tag, "--data", tiny_data, "--out", directory / tag, *FLAGS,
             *FAMILIES[family], "--mixed-precision",
             "off" if precision == "float32" else precision, *LAYOUTS[layout][2]]
            for layout, family, precision in runs if LAYOUTS[layout][0] == ranks
            for tag in [_tag(layout, family, precision)]])
    return directory


def _train_records(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = {r["step"]: r for r in records if r["split"] == "train"}
    assert sorted(records) == list(range(1, STEPS + 1)), run_dir.name
    return records


def _whole_weights(directory, tag, ranks, tensor=1):
    """`{path: array}` of the whole model the ranks hold between them, the
    slices of each tensor group (`tensor` consecutive ranks) joined; each
    variable that several ranks or tensor groups hold whole (a replicated
    norm, the tied table on both pipeline ends) must be the same on each."""
    files = [dict(np.load(directory / f"{tag}-rank-{rank}.npz")) for rank in range(ranks)]
    paths = sorted({key.split("/", 1)[1] for file in files for key in file
                    if key.startswith("weight/")})
    weights = {}
    for path in paths:
        holders = [(rank, file) for rank, file in enumerate(files) if f"weight/{path}" in file]
        if f"rule/{path}" in holders[0][1]:  # a tensor slice on each rank of a group
            rule = tuple(holders[0][1][f"rule/{path}"])
            copies = [(rank, join_slices([file[f"weight/{path}"]
                                          for _, file in holders[first:first + tensor]], rule))
                      for first, (rank, _) in enumerate(holders) if first % tensor == 0]
        else:
            copies = [(rank, file[f"weight/{path}"]) for rank, file in holders]
        for rank, copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0][1],
                                          err_msg=f"{tag}: {path} on rank {rank}")
        weights[path] = copies[0][1]
    return weights, files


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_layout_trains_the_family_as_one_process(layout_runs, family):
    directory = layout_runs
    runs = _runs()
    for precision, roundoff in PRECISIONS.items():
        if ("one", family, precision) not in runs:
            continue
        oracle_tag = _tag("one", family, precision)
        oracle = _train_records(directory / oracle_tag)
        losses = [oracle[step]["loss"] for step in oracle]
        assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.1, (oracle_tag, losses)
        assert min(oracle[step]["gradient_norm"] for step in oracle) > 1.0  # clipping acts
        expected, [initial_file] = _whole_weights(directory, oracle_tag, 1)
        initial = {path: initial_file[f"initial/{path}"] for path in expected}
        moved = np.sqrt(sum(((expected[p] - initial[p]) ** 2).sum() for p in expected))
        for layout, run_family, run_precision in runs:
            if layout == "one" or (run_family, run_precision) != (family, precision):
                continue
            tag = _tag(layout, family, precision)
            records = _train_records(directory / tag)
            for step, record in records.items():
                if precision == "float32":
                    assert record["loss"] == pytest.approx(
                        oracle[step]["loss"], rel=0, abs=FLOAT32_TOLERANCE), (tag, step)
                    assert record["gradient_norm"] == pytest.approx(
                        oracle[step]["gradient_norm"], rel=FLOAT32_TOLERANCE), (tag, step)
                    continue
                for key, bound in (("loss", roundoff), ("gradient_norm", 4 * roundoff)):
                    assert record[key] == pytest.approx(oracle[step][key], rel=bound), (
                        tag, step, key)
                if precision == "float16":  # the same loss scale, no step skipped
                    for key in ("loss_scale", "skipped_steps"):
                        assert record[key] == oracle[step][key], (tag, step, key)
            ranks, tensor, _ = LAYOUTS[layout]
            got, _ = _whole_weights(directory, tag, ranks, tensor)
            assert sorted(got) == sorted(expected), tag
            if precision == "float32":
                for path in expected:
                    np.testing.assert_allclose(got[path], expected[path], rtol=0,
                                               atol=FLOAT32_TOLERANCE, err_msg=f"{tag}: {path}")
                continue
            difference = np.sqrt(sum(((got[p] - expected[p]) ** 2).sum() for p in expected))
            assert difference <= WEIGHT_TOLERANCE * moved, (tag, difference / moved)
