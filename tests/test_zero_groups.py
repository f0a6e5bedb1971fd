"""ZeRO stage 1 with tensor and pipeline parallelism: each slice's or stage's
optimizer state sharded over its data group (`horovodrun -np 4`, 2 data replicas).

The equivalence tests run `tests/hvd_scripts` (float32, 6 steps, dropout
0) against one process on the same global batch; the `train_hvd.py` test
checks the start-up lines and that each run, cut back to its step-2
checkpoint, resumes to the same step-4 checkpoint, bit for bit (a run
killed after a save: tests/test_zero.py, tests/test_tensor_parallel_runs.py).
ZeRO-1 over data 2 x pipeline 2 x tensor 2 (its shards, its clipped
norm, its losses against one process, its checkpoint resumed on one
process): tests/test_resume_layouts.py.
"""

import shutil

import numpy as np
import pytest

from tests.launch import (
    REPO,
    checkpoint_tensors,
    held_weights,
    launch_each,
    run_and_load,
    run_each,
    saved_weights,
    train_losses,
)
from tests.test_tensor_parallel import _assert_slices_join_to

HVD_SCRIPTS = REPO / "tests" / "hvd_scripts"


def _shard_elements(result, data_index, replicas=2):
    """Elements of both AdamW moments of one rank's shards: its rows of each trained variable."""
    total = 0
    for shape in result["shapes"]:
        shape = [size for size in shape if size >= 0]
        base, extra = divmod(shape[0], replicas)
        rows = base + (1 if data_index < extra else 0)  # the first rows % replicas get one more
        total += 2 * rows * int(np.prod(shape[1:]))
    return total


def _assert_sharded(results, data_index_of, replicas=2):
    for rank, result in enumerate(results):
        whole = 2 * sum(int(np.prod([s for s in shape if s >= 0])) for shape in result["shapes"])
        shard = _shard_elements(result, data_index_of(rank), replicas)
        assert result["slot_elements"] == shard, rank
        # About 1 / replicas of the slice's or stage's moments.
        assert result["slot_elements"] < (1 / replicas + 0.1) * whole, rank


# ---- Equivalence with one process ----------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_with_zero_1_matches_one_process(tmp_path):
    script = HVD_SCRIPTS / "tensor_parallel_train.py"
    clip = ["--clip", "0.5"]  # the clipping needs the global norm over slices and shards
    oracles = run_each(script, tmp_path, 0, [("one-clip", *clip), ("one",)])
    oracle = oracles["one-clip"][0]
    results = run_and_load(script, tmp_path, "tp2-dp2", 4, "--tensor", "2", "--zero-stage", "1",
                           *clip)
    for result in results:
        np.testing.assert_allclose(result["losses"], oracle["losses"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(result["norms"], oracle["norms"], rtol=0, atol=1e-5)
    assert oracle["norms"].max() > 0.5  # clipping acted
    _assert_slices_join_to(results, 2, oracle, atol=1e-5)
    # Ranks 0, 1 are data replica 0's slices, ranks 2, 3 replica 1's.
    _assert_sharded(results, lambda rank: rank // 2)
    np.testing.assert_array_equal(results[0]["shapes"], results[2]["shapes"])
    # -np 2: TP2 alone, one data replica: nothing to shard over (no process
    # set for a group of one: no collective may run on the global set).
    _assert_alone_matches(run_and_load(script, tmp_path, "alone", 2, "--zero-stage", "1",
                                       "--tensor", "2"), oracles["one"][0])


def _assert_alone_matches(results, oracle):
    for result in results:
        np.testing.assert_allclose(result["losses"], oracle["losses"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(result["norms"], oracle["norms"], rtol=0, atol=1e-5)
    _assert_sharded(results, lambda rank: 0, replicas=1)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_with_zero_1_matches_one_process(tmp_path):
    script = HVD_SCRIPTS / "pipeline_check.py"
    flags = ["--clip", "0.3", "--rows", "16"]
    oracles = run_each(script, tmp_path, 0, [("one", *flags), ("one-weighted", *flags,
                                                                   "--weighted"), ("one-alone",)])
    oracle = oracles["one"][0]
    assert oracle["norms"].max() > 0.3  # clipping acted: the norm must be over every stage
    # And --task sft's weighted loss: each replica's micro-batches hold unequal
    # numbers of learned tokens, normalised by the global batch's.
    pipelined = ["--stages", "2", "--schedule", "1f1b", "--microbatches", "4", "--zero-stage",
                 "1", *flags]
    runs = run_each(script, tmp_path, 4, [("pp2-dp2", *pipelined),
                                          ("pp2-dp2-weighted", *pipelined, "--weighted")])
    results = runs["pp2-dp2"]
    for tag in ("", "-weighted"):
        expected = saved_weights(oracles[f"one{tag}"][0])
        for rank, result in enumerate(runs[f"pp2-dp2{tag}"]):
            for index, got in held_weights(result).items():  # its stage's alone
                np.testing.assert_allclose(got, expected[index], rtol=0, atol=1e-5,
                                           err_msg=f"{tag} rank {rank}, weight {index}")
            for kind in ("losses", "norms"):
                np.testing.assert_allclose(result[kind], oracles[f"one{tag}"][0][kind], rtol=0,
                                           atol=1e-5, err_msg=f"{tag} {kind}")
    assert set(held_weights(results[0])) | set(held_weights(results[1])) == set(
        range(len(expected)))
    # Ranks 0, 1 are pipeline 0's stages, ranks 2, 3 pipeline 1's.
    _assert_sharded(results, lambda rank: rank // 2)
    np.testing.assert_array_equal(results[1]["shapes"], results[3]["shapes"])

    # -np 2: PP2 alone, one data replica: nothing to shard over.
    _assert_alone_matches(run_and_load(script, tmp_path, "alone", 2, "--zero-stage", "1",
                                       "--stages", "2", "--microbatches", "4"),
                          oracles["one-alone"][0])


# ---- train_hvd.py: the start-up line, save and resume ----------------------------------

TINY_MODEL = [
    "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]


def _command(data, out, *layout, zero_stage=1):
    """train_hvd.py's arguments."""
    return ["--data", data, "--out", out, "--steps", "4",
            "--save-every", "2", "--log-every", "1", "--batch-size", "4", "--dropout", "0.0",
            "--eval-batches", "1", "--warmup-steps", "2", "--learning-rate", "3e-3",
            "--zero-stage", zero_stage, *TINY_MODEL, *layout]



ZERO_1_LAYOUTS = {
    "tensor": (["--tensor-parallel", "2"], "2 data replica(s) x tensor 2, this rank's slice"),
    "pipeline": (["--pipeline-parallel", "2", "--microbatches", "2"],
                 "2 data replica(s) x pipeline 2, this rank's stage"),
}


@pytest.mark.distributed
@pytest.mark.slow
def test_train_hvd_reports_the_shards_and_resumes_bitwise(tiny_data, tmp_path):
    """Data 2 x tensor 2 and data 2 x pipeline 2 with ZeRO-1, each trained
    straight to step 4 in one launch; a copy of each run cut back to its
    step-2 checkpoint resumes in a second launch and writes the same
    step-4 checkpoint, bit for bit."""
    from tfgpt.loading import load_model

    output = launch_each(REPO / "train_hvd.py", 4, [
        _command(tiny_data, tmp_path / name, *layout)
        for name, (layout, _) in ZERO_1_LAYOUTS.items()])
    for layout, ranks_line in ZERO_1_LAYOUTS.values():
        [line] = {line for line in output.splitlines() if f"(ZeRO stage 1, {ranks_line}): " in line}
        assert f"state per rank (ZeRO stage 1, {ranks_line}): parameters " in line, line
        assert "optimizer " in line, line
    _assert_rank_lines_show_shards(output, 2)  # the pipeline's line: each stage's rank
    for name in ZERO_1_LAYOUTS:
        resumed = tmp_path / f"{name}-resumed"
        shutil.copytree(tmp_path / name, resumed)
        shutil.rmtree(resumed / "ckpt-4")  # the checkpoint of step 2 is the latest
        (resumed / "metrics.jsonl").unlink()
    output = launch_each(REPO / "train_hvd.py", 4, [
        _command(tiny_data, tmp_path / f"{name}-resumed", *layout, "--resume")
        for name, (layout, _) in ZERO_1_LAYOUTS.items()])
    assert output.count("resumed from") >= 2, output
    for name in ZERO_1_LAYOUTS:
        straight, resumed = tmp_path / name, tmp_path / f"{name}-resumed"
        first, second = (checkpoint_tensors(run_dir / "ckpt-4") for run_dir in (straight, resumed))
        assert first.keys() == second.keys() and any(key.endswith("/velocity") for key in first)
        for key in first:
            np.testing.assert_array_equal(first[key], second[key], err_msg=f"{name}: {key}")
        expected, got = train_losses(straight), train_losses(resumed)
        assert sorted(got) == [3, 4], (name, got)
        for at_step in (3, 4):
            assert got[at_step] == expected[at_step], (name, at_step)
        # The weights read whole, as any run's.
        model, _ = load_model(str(straight))
        assert len(model.generate([[5, 6, 7]], max_new_tokens=2)[0]) == 2


def _assert_rank_lines_show_shards(output, ranks):
    """The pipeline line's per-rank bytes: whole weights and gradients of what
    each rank trains, half its moments (and a float32 copy of that half)."""
    import re

    from tfgpt.cli import byte_size

    line = next(line for line in output.splitlines() if "; per rank: " in line)
    found = re.findall(r"holds and trains ([\d,]+) parameters: parameters "
                       r"(.+?), gradients (.+?), optimizer ([^;]+)", line)
    assert len(found) == ranks, line
    for trained, parameters, gradients, optimizer in found:
        trained = int(trained.replace(",", ""))
        shard = -(-trained // 2)  # the first replica's share over 2
        assert (parameters, gradients, optimizer) == (
            byte_size(4 * (trained + shard)), byte_size(4 * trained), byte_size(8 * shard)), line
