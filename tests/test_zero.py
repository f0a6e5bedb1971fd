"""ZeRO stages 1-3 (tfgpt.parallel.zero): the same training as whole state, less memory.

The multi-process tests run `tests/hvd_scripts/zero_check.py` under
`horovodrun` (each rank on its rows of the same global batches) and
compare the final whole weights with one process trained on the whole
global batches (`--global`) and with stage 0. Their runs share one
launch per rank count (the module's fixture `zero_runs`).
"""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from tests.launch import (
    REPO,
    checkpoint_tensors,
    horovodrun,
    launch_each,
    launch_until_killed,
    run,
    run_each,
    saved_weights,
)

SCRIPT = REPO / "tests" / "hvd_scripts" / "zero_check.py"
TINY_MODEL = [
    "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]


# ---- The split and the byte counts (no processes) ------------------------------


@pytest.mark.parametrize("rows, size", [(5, 3), (2, 3), (7, 2), (6, 3), (1, 1)])
def test_shard_rows_is_numpys_array_split(rows, size):
    from tfgpt.parallel.zero import shard_rows

    counts, offsets = shard_rows(rows, size)
    parts = np.array_split(np.arange(rows), size)  # the first rows % size get one more
    assert counts == [len(part) for part in parts]
    assert offsets == list(np.cumsum([0] + counts[:-1]))
    for count, offset, part in zip(counts, offsets, parts):
        np.testing.assert_array_equal(np.arange(offset, offset + count), part)


def test_state_bytes_per_stage_at_two_ranks():
    from tfgpt.parallel.zero import state_bytes

    parameters = 1000
    state = {stage: state_bytes(parameters, stage, 2)["state"] for stage in range(4)}
    # 16 bytes a parameter whole; the moments, then gradients, then weights split.
    assert state == {0: 16000, 1: 4000 + 2000 + 4000 + 4000, 2: 6000 + 2000 + 4000,
                     3: 2000 + 2000 + 4000}
    assert state[3] / state[0] == 0.5
    with_unit = state_bytes(parameters, 3, 2, gathered=100)
    assert with_unit["gathered"] == 800 and with_unit["total"] == 8800
    assert state_bytes(parameters, 2, 2, gathered=100)["gathered"] == 0
    assert state_bytes(1001, 3, 2)["optimizer"] == 8 * 501  # the larger rank's share


# ---- Equivalence with whole-state training -------------------------------------


_weights = saved_weights


def _assert_weights_close(results, oracle, atol, what):
    expected = _weights(oracle)
    for rank, result in enumerate(results):
        got = _weights(result)
        assert len(got) == len(expected)
        for index, (a, b) in enumerate(zip(got, expected)):
            np.testing.assert_allclose(a, b, rtol=0, atol=atol,
                                       err_msg=f"{what}, rank {rank}, weight {index}")


CLIP = ["--clip", "0.3"]
LAMB = ["--optimizer", "lamb", "--clip", "0.3", "--accumulation", "2"]
FLOAT16 = ["--precision", "float16", "--overflow-step", "2"]
BFLOAT16 = ["--precision", "bfloat16"]
# The equivalence runs, one launch per rank count (each launch pays the
# processes' start-up once): tag -> flags.
RUNS = {
    0: {"global": CLIP, "lamb": LAMB, "adamw-accumulated": ["--accumulation", "2"]},
    2: {
        **{f"s{stage}": ["--stage", stage, *CLIP] for stage in range(4)},
        # --xla compiles the forward and backward pass; the collectives stay outside.
        "s2-xla": ["--stage", "2", "--xla", *CLIP],
        "f16-s0": ["--stage", "0", *FLOAT16], "f16-s3": ["--stage", "3", *FLOAT16],
        "bf16-s0": ["--stage", "0", *BFLOAT16], "bf16-s2": ["--stage", "2", *BFLOAT16],
        # test_a_stage_3_checkpoint_...: the run to resume (it writes
        # "checkpoint") and its uninterrupted oracle.
        "straight": ["--stage", "3"],
        "first-half": ["--stage", "3", "--stop-at", "3", "--checkpoint", "checkpoint"],
    },
    # 3 ranks: the tiny GPT's first dimensions (37, 7, 8, 24, ...) mostly do
    # not divide by 3, and the 8-row tables leave one rank fewer rows.
    3: {**{f"lamb-s{stage}": ["--stage", stage, *LAMB] for stage in (1, 2, 3)},
        "recompute-s3": ["--stage", "3", "--recompute", "--accumulation", "2"],
        # The two ranks' stage 3 checkpoint, each read from a copy of its own.
        "resumed-3-3": ["--stage", "3", "--checkpoint", "copy"],
        "resumed-3-1": ["--stage", "1", "--checkpoint", "copy"]},
}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """`RUNS`, run: (the directory, {tag: the ranks' files}). A run's
    `--checkpoint checkpoint` is DIRECTORY/checkpoint; `--checkpoint copy`
    a copy of it made for that run before its launch."""
    directory = tmp_path_factory.mktemp("zero")

    def flags_of(tag, flags):
        if flags[-2:] == ["--checkpoint", "copy"]:
            copy = directory / f"copy-{tag}"
            shutil.copytree(directory / "checkpoint", copy)
            return [*flags[:-1], copy]
        if flags[-2:] == ["--checkpoint", "checkpoint"]:
            return [*flags[:-1], directory / "checkpoint"]
        return flags

    results = {}
    for ranks, runs in RUNS.items():
        results.update(run_each(SCRIPT, directory, ranks, [
            (tag, *flags_of(tag, flags)) for tag, flags in runs.items()]))
    return directory, results


@pytest.mark.distributed
@pytest.mark.slow
def test_stages_match_whole_state_and_one_process_adamw_with_clipping(zero_runs):
    _, runs = zero_runs
    oracle = runs["global"][0]
    stage0 = runs["s0"]
    _assert_weights_close(stage0, oracle, 1e-5, "stage 0 against one process")
    for stage in (1, 2, 3):
        results = runs[f"s{stage}"]
        _assert_weights_close(results, oracle, 1e-5, f"stage {stage} against one process")
        _assert_weights_close(results, stage0[0], 1e-5, f"stage {stage} against stage 0")
        np.testing.assert_allclose(results[0]["norms"], oracle["norms"], rtol=1e-5)
    # Clipping was active: the first steps' norms are above the clip.
    assert oracle["norms"][0] > 0.3
    _assert_weights_close(runs["s2-xla"], oracle, 1e-5, "stage 2 with --xla against one process")


@pytest.mark.distributed
@pytest.mark.slow
def test_three_ranks_uneven_shards_lamb_accumulation_clipping_and_stage_3_recompute(zero_runs):
    _, runs = zero_runs
    for stage in (1, 2, 3):
        _assert_weights_close(runs[f"lamb-s{stage}"], runs["lamb"][0], 1e-5,
                              f"LAMB, stage {stage}, 3 ranks")
    _assert_weights_close(runs["recompute-s3"], runs["adamw-accumulated"][0], 1e-5,
                          "stage 3 with --recompute")


@pytest.mark.distributed
def test_stage_3_gathers_one_block_after_another(tmp_path):
    # Nothing but a dependency orders a graph's ops: unless each block's
    # all-gather waits for the block's input, every block's (and with
    # --recompute, every recomputation's) gather may run at the start of
    # the step, and the whole model exists at once.
    runs = {recompute: [tmp_path, f"order-{recompute}", "--stage", "3", "--gather-order"]
            + (["--recompute"] if recompute else []) for recompute in (False, True)}
    launch_each(SCRIPT, 2, runs.values())
    for recompute in runs:
        for rank in range(2):
            before = json.loads((tmp_path / f"order-{recompute}-rank-{rank}.json").read_text())
            # The rest of the model (embeddings, final norm) first, then the 3
            # blocks; recomputed in the backward pass, the 3 blocks again.
            gathers = 1 + 3 * (2 if recompute else 1)
            # One chain: the k-th gather depends on all k - 1 before it.
            assert sorted(before.values()) == list(range(gathers)), (recompute, before)


@pytest.mark.distributed
@pytest.mark.slow
def test_float16_overflow_is_skipped_by_every_rank_and_bfloat16_stage_2_matches_stage_0(
        zero_runs):
    _, runs = zero_runs
    for result in runs["f16-s0"] + runs["f16-s3"]:
        # 6 steps, one skipped: rank 0's loss alone was infinite at step 3.
        assert int(result["iterations"]) == 5
    # float16 activations: one process and 2 ranks of stage 0 differ by
    # about 8e-4 here (another order of the same sums), so 5e-3.
    _assert_weights_close(runs["f16-s3"], runs["f16-s0"][0], 5e-3,
                          "float16 stage 3 against stage 0")
    _assert_weights_close(runs["bf16-s2"], runs["bf16-s0"][0], 2e-2,
                          "bfloat16 stage 2 against stage 0")


# ---- Checkpoints that outlive the world size -----------------------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stage_3_checkpoint_of_two_ranks_resumes_on_one_and_three_and_back(zero_runs,
                                                                             tmp_path):
    # Written by the fixture's two-rank launch: "first-half" stopped at
    # step 3 with a checkpoint, "straight" the same run uninterrupted.
    directory, first = zero_runs
    checkpoint, single = directory / "checkpoint", tmp_path / "single"
    # The resumes read copies: each must find the checkpoint as it was
    # written (the fixture's three-rank launch resumed two of its own).
    copies = {(ranks, stage): tmp_path / f"copy-{ranks}-{stage}"
              for ranks, stage in ((1, 3), (2, 0))}

    def resume(ranks, stage):
        return (f"resumed-{ranks}-{stage}", "--stage", stage, "--checkpoint", copies[ranks, stage])

    straight = first["straight"][0]
    index = json.loads((checkpoint / "ckpt-3" / "index.json").read_text())
    assert index["layout"]["ranks"] == 2
    assert sorted(os.listdir(checkpoint / "ckpt-3")) == [
        "index.json", "rank-00000.json", "rank-00000.npz", "rank-00001.json", "rank-00001.npz"]
    # Each rank wrote its rows of every weight and moment: the first rows, then the rest.
    for key, entry in index["keys"].items():
        if not key.startswith(("optimizer/", "step", "rng/")):
            rows = sorted((chunk["rows"][:2], chunk["file"]) for chunk in entry["chunks"])
            assert [file for _, file in rows] == ["rank-00000.npz", "rank-00001.npz"], key
            assert rows[0][0][0] == 0 and rows[0][0][1] == rows[1][0][0], key
            assert rows[1][0][1] == entry["shape"][0], key
    for copy in copies.values():
        shutil.copytree(checkpoint, copy)
    # And the other way: one worker's stage 3 checkpoint (written in the
    # one-rank launch) resumed on two.
    results = run_each(SCRIPT, tmp_path, 1, [
        resume(1, 3), ("single-first-half", "--stage", "3", "--stop-at", "3",
                       "--checkpoint", single)])
    results.update({tag: first[tag] for tag in ("resumed-3-3", "resumed-3-1")})
    results.update(run_each(SCRIPT, tmp_path, 2, [
        resume(2, 0), ("resumed-from-one", "--stage", "3", "--checkpoint", single)]))
    assert sorted(os.listdir(single / "ckpt-3")) == [
        "index.json", "rank-00000.json", "rank-00000.npz"]
    for (ranks, stage) in [*copies, (3, 3), (3, 1)]:
        resumed = results[f"resumed-{ranks}-{stage}"]
        assert int(resumed[0]["start"]) == 3
        np.testing.assert_allclose(resumed[0]["losses"], straight["losses"][3:], rtol=0,
                                   atol=1e-5, err_msg=f"{ranks} ranks, stage {stage}")
        _assert_weights_close(resumed, straight, 1e-5, f"resumed on {ranks}, stage {stage}")
    resumed = results["resumed-from-one"]
    assert int(resumed[0]["start"]) == 3
    np.testing.assert_allclose(resumed[0]["losses"], straight["losses"][3:], rtol=0, atol=1e-5)
    _assert_weights_close(resumed, straight, 1e-5, "one worker's checkpoint resumed on 2")


@pytest.mark.distributed
@pytest.mark.slow
def test_train_hvd_stage_3_sigkill_resume_is_bitwise_and_generate_reads_it(tiny_data, tmp_path):
    def command(run_dir, *extra):
        return [REPO / "train_hvd.py", "--data", tiny_data, "--out", run_dir, "--steps", "8",
                "--save-every", "4", "--log-every", "2", "--batch-size", "4",
                "--dropout", "0.1", "--eval-batches", "1", "--peak-flops", "1e11",
                "--zero-stage", "3", *TINY_MODEL, *extra]

    # The straight run, then the killed one, in one launch: the kill ends it.
    code, output = launch_until_killed(REPO / "train_hvd.py", 2, [
        command(tmp_path / "straight")[1:],
        {"argv": command(tmp_path / "killed")[1:], "env": {"TFGPT_FAULT_KILL_AFTER_SAVE": "4"}}])
    assert (tmp_path / "straight" / "ckpt-8" / "index.json").exists(), output
    assert "state per rank (ZeRO stage 3, 2 rank(s))" in output
    assert code != 0 and not (tmp_path / "killed" / "ckpt-8" / "index.json").exists(), output
    assert (tmp_path / "killed" / "ckpt-4" / "index.json").exists(), output
    code, output = horovodrun(2, *command(tmp_path / "killed", "--resume"))
    assert code == 0, output
    assert "resumed from" in output and "next unseen batch" in output
    straight, resumed = (checkpoint_tensors(tmp_path / name / "ckpt-8")
                         for name in ("straight", "killed"))
    assert straight.keys() == resumed.keys()
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key], err_msg=key)

    # tfgpt.loading (generate, export, convert) reads the two ranks' rows of
    # each weight as one.
    from tfgpt.checkpoint.state import model_entries
    from tfgpt.loading import load_model

    model, _ = load_model(str(tmp_path / "straight"))
    for entry in model_entries(model):
        np.testing.assert_array_equal(entry.variable.numpy(), straight[entry.key], entry.key)
    code, output = run([sys.executable, "-m", "tfgpt.generate", "--checkpoint",
                        tmp_path / "straight", "--prompt", "the", "--max-new-tokens", "4"])
    assert code == 0, output

    # A shard file missing, or one from another run: one line, nothing written.
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "straight", broken)
    (broken / "ckpt-8" / "rank-00001.npz").unlink()
    before = sorted(os.listdir(broken))
    code, output = run([sys.executable, *command(broken, "--resume", "--steps", "10")])
    assert code == 2, output
    assert "its index names 1 chunk file(s) that are missing: rank-00001.npz" in output
    assert "Traceback" not in output and sorted(os.listdir(broken)) == before
    shutil.copy(tmp_path / "killed" / "ckpt-8" / "rank-00001.npz", broken / "ckpt-8")
    code, output = run([sys.executable, *command(broken, "--resume", "--steps", "10")])
    assert code == 2, output
    assert "rank-00001.npz does not belong to this checkpoint" in output
    assert "Traceback" not in output and not (broken / "ckpt-10").exists()


@pytest.mark.distributed
def test_stage_3_refuses_xla_and_one_worker_says_it_shards_nothing(tiny_data, tmp_path):
    flags = [REPO / "train_hvd.py", "--data", tiny_data, "--steps", "2", "--batch-size", "4",
             "--warmup-steps", "1", "--eval-batches", "1", "--peak-flops", "1e11", *TINY_MODEL]
    code, output = run([sys.executable, *flags, "--out", tmp_path / "xla", "--zero-stage", "3",
                        "--xla"])
    assert code == 2 and "Traceback" not in output, output
    assert "error: --xla cannot compile a --zero-stage 3 step" in output
    assert not (tmp_path / "xla" / "ckpt-2").exists()
    code, output = run([sys.executable, *flags, "--out", tmp_path / "one", "--zero-stage", "2"])
    assert code == 0, output
    assert "warning: --zero-stage 2 with one worker shards nothing" in output
    assert "state per rank (ZeRO stage 2, 1 rank(s))" in output
    assert (tmp_path / "one" / "ckpt-2" / "index.json").exists()
