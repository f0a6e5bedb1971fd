"""Tensor and pipeline parallelism in one run (data x pipeline x tensor ranks).

Each pipeline stage's blocks hold this rank's tensor slice; the stages of
one tensor index form a pipeline. Checked against one process on the same
global batch (`tests/hvd_scripts/pipeline_check.py --tensor`), and end to
end through `train_hvd.py`: the start-up lines, checkpoints, resume.
"""

import numpy as np
import pytest

from tests.launch import (
    REPO, assert_same_train_losses, horovodrun, run_each, saved_weights,
    train_losses,
)
from tfgpt.config.distribution import HorovodOptions

SCRIPT = REPO / "tests" / "hvd_scripts" / "pipeline_check.py"
# The tensor slices split the vocabulary: an even one.
VOCABULARY = ["--vocabulary", "38"]


def test_tensor_and_pipeline_parallelism_combine():
    options = HorovodOptions(tensor_parallel=2, pipeline_parallel=2, microbatches=2)
    assert (options.tensor_parallel, options.pipeline_parallel) == (2, 2)
    # ZeRO stage 1 shards each stage's slice's moments (tests/test_zero_groups.py); 2 and 3 stay refused.
    HorovodOptions(tensor_parallel=2, pipeline_parallel=2, microbatches=2, zero_stage=1)
    with pytest.raises(ValueError, match="--zero-stage 2 does not combine with --pipeline-parallel"):
        HorovodOptions(tensor_parallel=2, pipeline_parallel=2, microbatches=2, zero_stage=2)


def _assert_slices_join_to_the_oracle(results, oracle, tensor, what):
    """Every rank holds the whole model's slice of its tensor index; each
    tensor group's slices join into the oracle's weights."""
    from tfgpt.distributed.tensor_parallel import join_slices

    expected = saved_weights(oracle)
    for first in range(0, len(results), tensor):
        group = results[first:first + tensor]
        for index, weight in enumerate(expected):
            name = f"weight_{index}"
            if f"rule_{index}" in group[0]:
                whole = join_slices([r[name] for r in group], tuple(group[0][f"rule_{index}"]))
            else:
                whole = group[0][name]
            np.testing.assert_allclose(whole, weight, rtol=0, atol=1e-5,
                                       err_msg=f"{what}, ranks {first}-{first + tensor - 1}, "
                                               f"weight {index}")
    for result in results:
        np.testing.assert_allclose(result["losses"], oracle["losses"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(result["norms"], oracle["norms"], rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_stages_of_two_slices_and_a_vocabulary_parallel_head_match_one_process(tmp_path):
    # -np 4: stage 0 on ranks 0-1, stage 1 on ranks 2-3, each split in 2
    # slices; clipping acts, so the norm must count every stage and slice.
    clip = ["--clip", "0.3", *VOCABULARY]
    # With gpipe, the untied lm_head's V/T columns on each rank of the last stage.
    untied = ["--untied", "--layers", "3", *VOCABULARY]
    oracles = run_each(SCRIPT, tmp_path, 0, [("global", *clip), ("global-untied", *untied)])
    oracle = oracles["global"][0]
    assert oracle["norms"][0] > 0.3
    assert not np.allclose(oracle["losses"][0], oracle["losses"][-1])  # it trained
    runs = run_each(SCRIPT, tmp_path, 4, [
        ("1f1b", "--tensor", "2", "--stages", "2", "--schedule", "1f1b", "--microbatches", "4",
         *clip),
        ("gpipe", "--tensor", "2", "--stages", "2", "--schedule", "gpipe", "--microbatches", "2",
         *untied),
    ])
    # Split per block: the heads' projections in and out (3 variables), the
    # MLP's (3); and the token embedding.
    assert len([key for key in runs["1f1b"][0] if key.startswith("rule_")]) == 4 * 6 + 1
    _assert_slices_join_to_the_oracle(runs["1f1b"], oracle, 2, "1f1b")
    assert len([key for key in runs["gpipe"][0] if key.startswith("rule_")]) == 3 * 6 + 2
    _assert_slices_join_to_the_oracle(runs["gpipe"], oracles["global-untied"][0], 2,
                                      "gpipe, untied")


# ---- train_hvd.py end to end -------------------------------------------------------

TINY_MODEL = [
    "--num-layers", "3", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16", "--batch-size", "4",
]
PIPELINE = ["--pipeline-parallel", "2", "--microbatches", "2"]
THREE_D = ["--tensor-parallel", "2"]


def _train_hvd(workers, data, out, *flags, pipeline=PIPELINE, env=None):
    return horovodrun(workers, REPO / "train_hvd.py", "--data", data, "--out", out,
                      "--log-every", "1", "--eval-batches", "2", "--warmup-steps", "2",
                      *TINY_MODEL, *pipeline, *flags, env=env)


@pytest.mark.distributed
def test_ranks_that_are_not_data_x_pipeline_x_tensor_is_one_error_line(tiny_data, tmp_path):
    code, output = _train_hvd(2, tiny_data, tmp_path / "run", "--steps", "1", *THREE_D)
    assert code != 0
    message = "size=2, tensor_parallel=2, pipeline_parallel=2"
    assert [line for line in output.splitlines() if "error:" in line and message in line], output
    assert "model: " not in output, output  # before the model is built


@pytest.mark.distributed
@pytest.mark.slow
def test_a_three_d_run_names_its_layout_resumes_and_merges_into_a_pipeline_run(
        tiny_data, tmp_path):
    from tfgpt.training.tensor_checkpoint import main as tensor_checkpoint

    # The oracles: the same batches through a pipeline of whole blocks, and
    # the same layout uninterrupted.
    whole, cut, merged = tmp_path / "whole", tmp_path / "cut", tmp_path / "merged"
    straight = tmp_path / "straight"
    code, output = _train_hvd(2, tiny_data, whole, "--steps", "4")
    assert code == 0, output
    code, output = _train_hvd(4, tiny_data, straight, "--steps", "4", "--save-every", "2",
                              *THREE_D)
    assert code == 0, output
    # SIGKILLed right after its save at step 2.
    code, output = _train_hvd(4, tiny_data, cut, "--steps", "4", "--save-every", "2", *THREE_D,
                              env={"TFGPT_FAULT_KILL_AFTER_SAVE": "2"})
    assert code != 0 and not (cut / "ckpt-4.index").exists(), output
    # Which rank holds which blocks and which slice, and its bytes: a slice
    # of a block (C = 32, I = 48, T = 2) has its norms, the query/key/value
    # and feed-forward columns, the output and second feed-forward rows and
    # the row-parallel layers' biases; the first stage the token table's
    # V/T rows and the position table, the last its copy of those rows and
    # the final norm.
    from tfgpt.training.loop import byte_size

    width, inner, vocabulary_rows, positions = 32, 48 // 2, 300 // 2, 16
    block = (4 * width + width * 3 * width // 2 + 3 * width // 2 + width // 2 * width + width
             + width * inner + inner + inner * width + width)
    first = vocabulary_rows * width + positions * width + 2 * block
    last = block + 2 * width + vocabulary_rows * width
    held = first + block + 2 * width
    for rank, (stage, blocks, trained) in enumerate(
            [(0, "0-1", first), (0, "0-1", first), (1, "2-2", last), (1, "2-2", last)]):
        assert (f"rank {rank}: stage {stage} blocks {blocks}, tensor slice {rank % 2 + 1}/2, "
                f"trains {trained:,} of the {held:,} parameters it holds: parameters "
                f"{byte_size(4 * held)}, gradients {byte_size(4 * trained)}, optimizer "
                f"{byte_size(8 * trained)}") in output, output
    assert "layout: 4 rank(s) = data 1 x pipeline 2 x tensor 2" in output
    tensor_checkpoint(["merge", str(cut), str(merged)])  # at step 2
    # Round trip: TP2 x PP2 (1F1B) -> PP2 -> ordinary -> TP2 x PP2 (GPipe).
    ordinary, resplit = tmp_path / "ordinary", tmp_path / "resplit"
    gpipe = [*PIPELINE, "--pipeline-schedule", "gpipe"]
    tensor_checkpoint(["merge", str(merged), str(ordinary)])
    tensor_checkpoint(["split", str(ordinary), str(resplit), *THREE_D, *gpipe])
    code, output = _train_hvd(4, tiny_data, resplit, "--steps", "4", "--resume", *THREE_D,
                              pipeline=gpipe)
    assert code == 0, output
    assert "resumed from" in output and "next unseen batch" in output, output
    code, output = _train_hvd(4, tiny_data, cut, "--steps", "4", "--save-every", "2", "--resume",
                              *THREE_D)
    assert code == 0, output
    assert "resumed from" in output
    # The same layout resumes bit for bit.
    resumed, uninterrupted = train_losses(cut), train_losses(straight)
    for step in (3, 4):
        assert resumed[step] == uninterrupted[step], step
    # The merged checkpoint goes on as a pipeline run of whole blocks.
    code, output = _train_hvd(2, tiny_data, merged, "--steps", "4", "--resume")
    assert code == 0, output
    assert "resumed from" in output
    losses = assert_same_train_losses(whole, [cut], 4, 1e-5)
    assert losses[4] < losses[1]
    # Generation, export and conversion read the slices as the whole model.
    import tensorflow as tf

    from tfgpt.loading import load_model

    tokens = tf.constant([[1, 2, 3, 4, 5]])
    np.testing.assert_allclose(load_model(str(cut))[0](tokens), load_model(str(whole))[0](tokens),
                               rtol=0, atol=1e-4)
    # Without the pipeline the slices lack their optimizer state: one line says what to do.
    code, output = _train_hvd(2, tiny_data, cut, "--steps", "5", "--resume", *THREE_D,
                              pipeline=[])
    assert code != 0
    assert "was written by a --pipeline-parallel run: resume with its" in output, output
    # Nor with --zero-stage 1: its optimizer state is whole, not this rank's shards.
    code, output = _train_hvd(4, tiny_data, cut, "--steps", "5", "--resume", *THREE_D,
                              "--zero-stage", "1")
    assert code != 0
    assert [line for line in output.splitlines() if "error:" in line
            and "has no ZeRO shards for this rank" in line], output
    for other in (merged, resplit):
        resumed = train_losses(other)
        assert sorted(resumed) == [3, 4]
        for step in resumed:
            assert resumed[step] == pytest.approx(losses[step], abs=1e-5), (other.name, step)


def _shard_optimizer_state(run_dir, replicas):
    """Rewrites each stage slice's optimizer state of the TP x PP checkpoint in
    `run_dir` as `replicas` data replicas' ZeRO-1 shards would write it:
    `replica-D-of-N/ckpt-S` with replica D's rows of the stage slice's
    variables (`shard_rows`) and an optimizer built on them."""
    import os

    import keras
    import tensorflow as tf

    from tfgpt.distributed.tensor_parallel import TensorSlice
    from tfgpt.distributed.zero import shard_rows, slot_variables
    from tfgpt.training.checkpointing import Checkpointer
    from tfgpt.training.optimizers import make_optimizer
    from tfgpt.training.tensor_checkpoint import (
        _build, _pipeline_stages, _run_configs, pipeline_cut, read_optimizer_state, step_of,
    )
    from tfgpt.training.tensor_pipeline_checkpoint import optimizer_directory

    record, family, model_config, train_config = _run_configs(str(run_dir))
    step = step_of(tf.train.latest_checkpoint(str(run_dir)))
    size = record["train"]["tensor_parallel"]
    for index in range(size):
        part, _ = _build(family, model_config, train_config, TensorSlice(None, None, size, index))
        for rank, (stage, optimizer) in enumerate(_pipeline_stages(
                part, pipeline_cut(record["train"]), record["data"]["seq_len"], train_config)):
            directory = optimizer_directory(str(run_dir), rank, index, size)
            variables = stage.trainable_variables
            read_optimizer_state(directory, step, optimizer, variables, train_config)
            for replica in range(replicas):
                rows = [slice(offsets[replica], offsets[replica] + counts[replica])
                        for counts, offsets in (shard_rows(v.shape[0], replicas)
                                                for v in variables)]
                shards = [keras.Variable(v.numpy()[r], name=v.name) for v, r in zip(variables, rows)]
                shard_optimizer = make_optimizer(train_config, 1)
                shard_optimizer.build(shards)
                for name, moments in slot_variables(shard_optimizer).items():
                    for moment, whole, r in zip(moments, slot_variables(optimizer)[name], rows):
                        moment.assign(whole.numpy()[r])
                shard_optimizer.iterations.assign(optimizer.iterations)
                Checkpointer(os.path.join(directory, f"replica-{replica}-of-{replicas}"), True,
                             optimizer=shard_optimizer,
                             shards=[shard.value for shard in shards]).save(step)
            for name in os.listdir(directory):
                if not name.startswith("replica-"):
                    os.remove(os.path.join(directory, name))


def _whole_state(run_dir):
    """Every variable of the ordinary checkpoint in `run_dir`, by name."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run_dir)))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith(("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter"))}


@pytest.mark.slow
def test_an_ordinary_checkpoint_split_into_tensor_and_pipeline_merges_back_zero_shards_too(
        tiny_data, tmp_path):
    import shutil
    import sys

    from tests.launch import run
    from tfgpt.training.tensor_checkpoint import main as tensor_checkpoint

    ordinary = tmp_path / "ordinary"
    code, output = run([sys.executable, REPO / "train_hvd.py", "--data", tiny_data, "--out",
                        ordinary, "--steps", "2", "--eval-batches", "1", "--warmup-steps", "1",
                        *TINY_MODEL])
    assert code == 0, output
    cut = tmp_path / "cut"
    tensor_checkpoint(["split", str(ordinary), str(cut), *THREE_D, *PIPELINE])
    # The same optimizer state, as 2 data replicas under ZeRO-1 would write it.
    shutil.copytree(cut, tmp_path / "sharded")
    _shard_optimizer_state(tmp_path / "sharded", 2)
    expected = _whole_state(ordinary)
    assert any("optimizer" in name for name in expected)
    for layout in ("cut", "sharded"):
        # TP2 x PP2 -> PP2 -> ordinary: the checkpoint split.
        tensor_checkpoint(["merge", str(tmp_path / layout), str(tmp_path / f"{layout}-pp")])
        tensor_checkpoint(["merge", str(tmp_path / f"{layout}-pp"),
                           str(tmp_path / f"{layout}-whole")])
        merged = _whole_state(tmp_path / f"{layout}-whole")
        assert merged.keys() == expected.keys(), layout
        for name, value in expected.items():
            np.testing.assert_array_equal(merged[name], value, err_msg=f"{layout} {name}")
