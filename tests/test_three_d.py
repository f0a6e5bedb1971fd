"""Tensor and pipeline parallelism in one run (data x pipeline x tensor ranks).

Each pipeline stage's blocks hold this rank's tensor slice; the stages of
one tensor index form a pipeline. Checked against one process on the same
global batch (`tests/hvd_scripts/pipeline_check.py --tensor`; GPT-2-shaped,
and each other decoder family's shape with `--recompute`), and end to end through
`train_hvd.py`: the start-up lines, checkpoints, resume.
"""

import json
import shutil

import numpy as np
import pytest

from tests.launch import (
    REPO,
    checkpoint_tensors,
    held_weights,
    horovodrun,
    run_each,
    saved_weights,
    train_losses,
)
from tfgpt.config.distribution import HorovodOptions

SCRIPT = REPO / "tests" / "hvd_scripts" / "pipeline_check.py"
# The tensor slices split the vocabulary: an even one.
VOCABULARY = ["--vocabulary", "38"]


def test_tensor_and_pipeline_parallelism_combine():
    options = HorovodOptions(tensor_parallel=2, pipeline_parallel=2, microbatches=2)
    assert (options.tensor_parallel, options.pipeline_parallel) == (2, 2)
    # ZeRO stage 1 shards each stage's slice's moments (tests/test_resume_layouts.py);
    # stages 2 and 3 stay refused.
    HorovodOptions(tensor_parallel=2, pipeline_parallel=2, microbatches=2, zero_stage=1)
    with pytest.raises(ValueError,
                       match="--zero-stage 2 does not combine with --pipeline-parallel"):
        HorovodOptions(tensor_parallel=2, pipeline_parallel=2, microbatches=2, zero_stage=2)


def _assert_slices_join_to_the_oracle(results, oracle, tensor, what):
    """Every rank holds the whole model's slice of its tensor index; each
    tensor group's slices join into the oracle's weights."""
    from tfgpt.parallel.tensor_parallel import join_slices

    expected = saved_weights(oracle)
    covered = set()
    for first in range(0, len(results), tensor):
        group = results[first:first + tensor]
        held = held_weights(group[0])  # its stage's weights alone
        assert len(held) < len(expected), (what, first)
        covered |= set(held)
        for index in held:
            weight, name = expected[index], f"weight_{index}"
            if f"rule_{index}" in group[0]:
                whole = join_slices([r[name] for r in group], tuple(group[0][f"rule_{index}"]))
            else:
                whole = group[0][name]
            np.testing.assert_allclose(whole, weight, rtol=0, atol=1e-5,
                                       err_msg=f"{what}, ranks {first}-{first + tensor - 1}, "
                                               f"weight {index}")
    assert covered == set(range(len(expected))), what
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
    # The other decoder families (GPT-2's and Llama's: above and in
    # tests/test_resume_layouts.py), with each block recomputed: GPT-J's head
    # bias split by vocabulary on the last stage (and its parallel residual),
    # GPT-Neo's local blocks, Pythia's two-norm residual, Qwen2's query/key/value
    # biases over 2 key-value heads, one on each slice, Mistral's window.
    families = {family: ["--family", family, "--recompute", *clip]
                for family in ("gptj", "gpt-neo", "pythia", "qwen2", "mistral")}
    oracles = run_each(SCRIPT, tmp_path, 0, [
        ("global", *clip), ("global-untied", *untied),
        *[(f"global-{family}", *flags) for family, flags in families.items()]])
    oracle = oracles["global"][0]
    assert oracle["norms"][0] > 0.3
    assert not np.allclose(oracle["losses"][0], oracle["losses"][-1])  # it trained
    three_d = ["--tensor", "2", "--stages", "2", "--schedule", "1f1b"]
    runs = run_each(SCRIPT, tmp_path, 4, [
        ("1f1b", *three_d, "--microbatches", "4", *clip),
        ("gpipe", "--tensor", "2", "--stages", "2", "--schedule", "gpipe", "--microbatches", "2",
         *untied),
        *[(family, *three_d, "--microbatches", "2", *flags) for family, flags in families.items()],
    ])
    # Split per block: the heads' projections in and out (3 variables), the
    # MLP's (3); and the token embedding.
    assert len([key for key in runs["1f1b"][0] if key.startswith("rule_")]) == 4 * 6 + 1
    _assert_slices_join_to_the_oracle(runs["1f1b"], oracle, 2, "1f1b")
    assert len([key for key in runs["gpipe"][0] if key.startswith("rule_")]) == 3 * 6 + 2
    _assert_slices_join_to_the_oracle(runs["gpipe"], oracles["global-untied"][0], 2,
                                      "gpipe, untied")
    # Split per block: GPT-J's 5 (GPT-2's but the query/key/value bias), and
    # its head and the head's bias; GPT-Neo's 5 (the same) and its tied table;
    # Pythia's 6 (GPT-2's), its head and table; Qwen2's 8 (the queries' and the
    # keys' and values' kernels and biases, the output, the gated network's 3
    # kernels); Mistral's 6 (Qwen2's but the biases), its head and table.
    for family, split in (("gptj", 4 * 5 + 3), ("gpt-neo", 4 * 5 + 1), ("pythia", 4 * 6 + 2),
                          ("qwen2", 4 * 8 + 1), ("mistral", 4 * 6 + 2)):
        assert len([key for key in runs[family][0] if key.startswith("rule_")]) == split, family
        assert oracles[f"global-{family}"][0]["norms"][0] > 0.3, family
        _assert_slices_join_to_the_oracle(runs[family], oracles[f"global-{family}"][0], 2,
                                          f"{family}, 1f1b, --recompute")


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
def test_a_three_d_run_names_its_layout_resumes_bitwise_and_reads_whole(tiny_data, tmp_path):
    # The oracle: the same layout uninterrupted. (Resuming it on other
    # layouts: tests/test_resume_layouts.py; a 3D run killed right after a
    # save: tests/test_tensor_parallel_runs.py and tests/test_zero.py kill
    # the other layouts, whose checkpoints this one's format shares.)
    cut, straight = tmp_path / "cut", tmp_path / "straight"
    code, output = _train_hvd(4, tiny_data, straight, "--steps", "4", "--save-every", "2",
                              *THREE_D)
    assert code == 0, output
    # A copy cut back to its step-2 checkpoint resumes.
    shutil.copytree(straight, cut)
    shutil.rmtree(cut / "ckpt-4")
    (cut / "metrics.jsonl").unlink()
    # Which rank holds which blocks and which slice, and its bytes: a slice
    # of a block (C = 32, I = 48, T = 2) has its norms, the query/key/value
    # and feed-forward columns, the output and second feed-forward rows and
    # the row-parallel layers' biases; the first stage the token table's
    # V/T rows and the position table, the last its copy of those rows and
    # the final norm.
    from tfgpt.cli import byte_size

    width, inner, vocabulary_rows, positions = 32, 48 // 2, 300 // 2, 16
    block = (4 * width + width * 3 * width // 2 + 3 * width // 2 + width // 2 * width + width
             + width * inner + inner + inner * width + width)
    first = vocabulary_rows * width + positions * width + 2 * block
    last = block + 2 * width + vocabulary_rows * width
    for rank, (stage, blocks, trained) in enumerate(
            [(0, "0-1", first), (0, "0-1", first), (1, "2-2", last), (1, "2-2", last)]):
        assert (f"rank {rank}: stage {stage} blocks {blocks}, tensor slice {rank % 2 + 1}/2, "
                f"holds and trains {trained:,} parameters: parameters "
                f"{byte_size(4 * trained)}, gradients {byte_size(4 * trained)}, optimizer "
                f"{byte_size(8 * trained)}") in output, output
    assert "layout: 4 rank(s) = data 1 x pipeline 2 x tensor 2" in output
    code, output = _train_hvd(4, tiny_data, cut, "--steps", "4", "--save-every", "2", "--resume",
                              *THREE_D)
    assert code == 0, output
    assert "resumed from" in output and "next unseen batch" in output, output
    # The same layout resumes bit for bit.
    resumed, uninterrupted = train_losses(cut), train_losses(straight)
    for step in (3, 4):
        assert resumed[step] == uninterrupted[step], step
    assert uninterrupted[4] < uninterrupted[1]
    first, second = (checkpoint_tensors(run / "ckpt-4") for run in (straight, cut))
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    # Each weight is written once: by its stage's ranks of the first data
    # replica, a split one by both slices, a replicated one by the first.
    index = json.loads((cut / "ckpt-4" / "index.json").read_text())
    writers = {
        "embeddings/token_embedding/embeddings": [0, 1],  # the first stage's (tied) V/T rows
        "block_2/attention/query_key_value/kernel": [2, 3],
        "block_0/attention_norm/gamma": [0],
        "final_norm/gamma": [2],
    }
    for key, ranks in writers.items():
        files = sorted(chunk["file"] for chunk in index["keys"][key]["chunks"])
        assert files == [f"rank-{rank:05d}.npz" for rank in ranks], key
    # Generation, export and conversion read the slices as the whole model.
    from tfgpt.checkpoint.state import model_entries
    from tfgpt.loading import load_model

    model, _ = load_model(str(cut))
    saved = checkpoint_tensors(cut / "ckpt-4")
    for entry in model_entries(model):
        np.testing.assert_array_equal(entry.variable.numpy(), saved[entry.key], entry.key)
