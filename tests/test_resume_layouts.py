"""Any layout resumes any other's checkpoint and goes on as the uninterrupted run.

Every run here reads one global order of the records (`--global-order`)
in global batches of 12 sequences, in float32, without dropout and with a
learning rate that does not scale with the data replicas: whatever the
layout, step s sees the same batch and takes the same update. The model is
Llama-shaped (RMSNorm, rotary positions, 4 query heads sharing 2 key-value
heads, a SwiGLU feed-forward network, no biases, an untied head), so the
layouts split grouped-query attention and gated networks too (GPT-2's
shape is in every other multi-process test). One process and five layouts
write a checkpoint at step 2 and train on to step 4, with the same losses
at every step within 1e-5; each layout's checkpoint is resumed on another
layout from step 2, which must log the writer's losses at steps 3 and 4
within 1e-5. Global-norm clipping acts at every step, so each layout's
norm must count every replica's, slice's, stage's and shard's part once:
the writers log one process's gradient norms.

The pairs (writer -> reader) cover every writer and every reader the
checkpoint format distinguishes: row shards, tensor slices, pipeline
stages and their combination, written and read:

    DP2               -> PP2, interleaved (2 virtual stages)
    ZeRO-3 on 2 ranks -> TP2
    TP2               -> ZeRO-2 on 3 ranks
    PP2, 1F1B         -> one process
    DP2 x PP2 x TP2, ZeRO-1 -> one process

The 3D writer also reports its shards at start-up (each stage's slice's
moments in its 2 data replicas' rows) and writes each replica's rows.
"""

import json
import shutil

import numpy as np
import pytest

from tests.launch import REPO, launch_each, train_losses, validation_loss

CLIP = 1.0  # below every step's gradient norm here: clipping acts at each step
FLAGS = [
    "--steps", "4", "--save-every", "2", "--keep-checkpoints", "2", "--log-every", "1",
    "--dropout", "0.0", "--eval-batches", "3", "--peak-flops", "1e11",
    "--learning-rate", "3e-3", "--warmup-steps", "1", "--no-scale-learning-rate",
    "--global-order", "--gradient-clip-norm", CLIP, "--num-layers", "4", "--num-heads", "4",
    "--hidden-dim", "32", "--intermediate-dim", "48", "--max-sequence-length", "16",
    # Llama's switches (tfgpt.config.models.DECODER_PRESETS).
    "--norm", "rms", "--positions", "rotary", "--num-key-value-heads", "2",
    "--feedforward", "gated", "--activation", "silu", "--no-attention-bias",
    "--no-output-bias", "--no-feedforward-bias", "--no-tie-embeddings",
]
PIPELINE = ["--pipeline-parallel", "2", "--microbatches", "4"]
# name: (ranks, flags); 12 sequences per step in every layout.
LAYOUTS = {
    "one": (1, ["--batch-size", "12"]),
    "dp2": (2, ["--batch-size", "6"]),
    "zero3x2": (2, ["--batch-size", "6", "--zero-stage", "3"]),
    "zero2x3": (3, ["--batch-size", "4", "--zero-stage", "2"]),
    "tp2": (2, ["--batch-size", "12", "--tensor-parallel", "2"]),
    "pp2": (2, ["--batch-size", "12", *PIPELINE]),
    "pp2-interleaved": (2, ["--batch-size", "12", *PIPELINE, "--pipeline-schedule",
                            "interleaved", "--virtual-stages", "2"]),
    "dp2xpp2xtp2-zero1": (8, ["--batch-size", "6", "--tensor-parallel", "2",
                              "--pipeline-parallel", "2", "--microbatches", "2",
                              "--zero-stage", "1"]),
}
PAIRS = [("dp2", "pp2-interleaved"), ("zero3x2", "tp2"), ("tp2", "zero2x3"), ("pp2", "one"),
         ("dp2xpp2xtp2-zero1", "one")]


def _train_each(data, runs):
    """Trains each `(layout, out, *flags)` of `runs` (all of one rank count),
    one after another in one launch; returns the output."""
    ranks = LAYOUTS[runs[0][0]][0]
    assert all(LAYOUTS[layout][0] == ranks for layout, *_ in runs)
    return launch_each(REPO / "train_hvd.py", 0 if ranks == 1 else ranks, [
        ["--data", data, "--out", out, *FLAGS, *LAYOUTS[layout][1], *extra]
        for layout, out, *extra in runs])


@pytest.mark.distributed
@pytest.mark.slow
def test_each_layout_resumes_another_layouts_checkpoint_with_the_uninterrupted_losses(
        tiny_data, tmp_path):
    writers = sorted({writer for writer, _ in PAIRS} | {"one"})
    outputs = {}
    for ranks in sorted({LAYOUTS[writer][0] for writer in writers}):
        outputs[ranks] = _train_each(tiny_data, [(writer, tmp_path / writer)
                                                 for writer in writers
                                                 if LAYOUTS[writer][0] == ranks])
    _assert_three_d_zero_1_shards(outputs[8], tmp_path / "dp2xpp2xtp2-zero1")
    losses = {writer: train_losses(tmp_path / writer) for writer in writers}
    norms = {writer: _gradient_norms(tmp_path / writer) for writer in writers}
    # The layouts are one computation: the writers agree with one process at every step.
    for writer in writers:
        assert sorted(losses[writer]) == [1, 2, 3, 4], writer
        for step in (1, 2, 3, 4):
            assert losses[writer][step] == pytest.approx(losses["one"][step], abs=1e-5), (
                writer, step)
            assert norms[writer][step] == pytest.approx(norms["one"][step], rel=1e-5), (
                writer, step)
    assert losses["one"][4] < losses["one"][1]
    assert min(norms["one"].values()) > CLIP  # clipping acted at every step

    for writer, reader in PAIRS:
        resumed = tmp_path / f"{writer}-on-{reader}"
        shutil.copytree(tmp_path / writer, resumed)
        shutil.rmtree(resumed / "ckpt-4")  # the checkpoint of step 2 is the latest
        (resumed / "metrics.jsonl").unlink()
    for ranks in sorted({LAYOUTS[reader][0] for _, reader in PAIRS}):
        output = _train_each(tiny_data, [(reader, tmp_path / f"{writer}-on-{reader}", "--resume")
                                         for writer, reader in PAIRS
                                         if LAYOUTS[reader][0] == ranks])
        assert output.count("at step 2, data position 24 of the global order") == sum(
            LAYOUTS[reader][0] == ranks for _, reader in PAIRS), output
    for writer, reader in PAIRS:
        got = train_losses(tmp_path / f"{writer}-on-{reader}")
        assert sorted(got) == [3, 4], (writer, reader, got)
        for step in (3, 4):
            assert got[step] == pytest.approx(losses[writer][step], abs=1e-5), (
                writer, reader, step)

    # The ranks of a tensor group validate on one batch (their first rank's),
    # and a pipeline through its stages, each rank holding its own: the same
    # loss as one process on the same model and batches.
    for run in ("tp2", "pp2", "pp2-on-one", "dp2-on-pp2-interleaved"):
        assert validation_loss(tmp_path / run) == pytest.approx(
            validation_loss(tmp_path / "one"), abs=1e-5), run

    # Generation, export and conversion read any layout's checkpoint as the whole model.
    import tensorflow as tf

    from tfgpt.loading import load_model

    tokens = tf.constant([[1, 2, 3, 4, 5]])
    np.testing.assert_allclose(load_model(str(tmp_path / "dp2xpp2xtp2-zero1"))[0](tokens),
                               load_model(str(tmp_path / "dp2"))[0](tokens), rtol=0, atol=1e-4)


def _gradient_norms(run_dir):
    """The gradient norm (before clipping) a run logged at each step."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["gradient_norm"] for r in records if r["split"] == "train"}


def _assert_three_d_zero_1_shards(output, run_dir):
    from tests.test_zero_groups import _assert_rank_lines_show_shards

    assert ("state per rank (ZeRO stage 1, 2 data replica(s) x pipeline 2 x tensor 2, this "
            "rank's stage's slice): parameters ") in output, output
    _assert_rank_lines_show_shards(output, 4)
    # A stage's slice's moment (C = 32 rows): each data replica wrote its half.
    index = json.loads((run_dir / "ckpt-4" / "index.json").read_text())
    chunks = index["keys"]["block_1/attention/query/kernel/momentum"]["chunks"]
    assert sorted((chunk["tensor"][1], chunk["rows"][0]) for chunk in chunks) == [
        (0, 0), (0, 16), (1, 0), (1, 16)], chunks
