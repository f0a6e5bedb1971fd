"""`train_hvd.py --tensor-parallel`: refusals, checkpoints, resuming on the same layout."""


import numpy as np
import pytest

from tests.launch import REPO, checkpoint_tensors, horovodrun, launch_until_killed, train_losses
from tfgpt.config import GPTConfig

TINY_MODEL = [
    "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]


# ---- Refusals: one line each, before any compute -------------------------------------


def _check(tensor=2, model=None):
    from tfgpt.parallel.tensor_parallel import check_sizes

    model_config = GPTConfig(**{"vocabulary_size": 300, "num_heads": 2, "hidden_dim": 32,
                                "intermediate_dim": 48, **(model or {})})
    check_sizes(tensor, model_config)


@pytest.mark.parametrize("model, match", [
    ({"num_heads": 1, "hidden_dim": 32},
     r"--tensor-parallel 2 must divide `num_heads`. Received: num_heads=1"),
    ({"intermediate_dim": 47},
     r"--tensor-parallel 2 must divide `intermediate_dim`. Received: intermediate_dim=47"),
    ({"vocabulary_size": 301},
     r"must divide `vocabulary_size`. Received: vocabulary_size=301.*--vocabulary-size 302"),
    ({"num_heads": 4, "num_key_value_heads": 1},
     r"--tensor-parallel 2 must divide `num_key_value_heads`. Received: num_key_value_heads=1"),
])
def test_a_size_the_tensor_parallel_degree_does_not_divide_is_refused(model, match):
    with pytest.raises(ValueError, match=match):
        _check(model=model)


def test_the_option_must_be_a_positive_integer():
    from tfgpt.config.distribution import HorovodOptions

    with pytest.raises(ValueError, match="`tensor_parallel` must be a positive integer. "
                                         "Received: tensor_parallel=0"):
        HorovodOptions(tensor_parallel=0)


@pytest.mark.distributed
@pytest.mark.parametrize("flags, line", [
    (["--tensor-parallel", "3"],
     "error: The number of ranks must be data x pipeline x tensor: --tensor-parallel 3 x "
     "--pipeline-parallel 1 does not divide the 2 rank(s) of horovodrun -np 2"),
    (["--tensor-parallel", "2", "--intermediate-dim", "47"],
     "error: --tensor-parallel 2 must divide `intermediate_dim`"),
])
def test_train_hvd_refuses_in_one_line_before_training(tiny_data, tmp_path, flags, line):
    code, output = horovodrun(2, REPO / "train_hvd.py", "--data", tiny_data, "--out",
                              tmp_path / "run", "--steps", "2", *TINY_MODEL, *flags)
    assert code != 0
    assert line in output, output
    # (horovodrun's own traceback reports the exit status; none from the ranks.)
    assert "<stderr>:Traceback" not in output and "train step" not in output


# ---- Checkpoints ---------------------------------------------------------------------


def _command(data, run_dir, *extra, dropout="0.0"):
    return [REPO / "train_hvd.py", "--data", data, "--out", run_dir, "--steps", "12",
            "--save-every", "6", "--log-every", "2", "--batch-size", "4", "--dropout", dropout,
            "--eval-batches", "1", "--peak-flops", "1e11", "--learning-rate", "3e-3",
            "--warmup-steps", "2", *TINY_MODEL, *extra]


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_and_resume_on_the_same_layout_is_bitwise(tiny_data, tmp_path):
    tensor = ["--tensor-parallel", "2", "--recompute"]  # dropout recomputed in each slice
    killed = tmp_path / "killed"
    # The straight run, then the killed one, in one launch: the kill ends it.
    code, output = launch_until_killed(REPO / "train_hvd.py", 2, [
        _command(tiny_data, tmp_path / "straight", *tensor, "--keep-checkpoints", "1",
                 dropout="0.1")[1:],
        {"argv": _command(tiny_data, killed, *tensor, dropout="0.1")[1:],
         "env": {"TFGPT_FAULT_KILL_AFTER_SAVE": "6"}}])
    assert "layout: 2 rank(s) = data 1 x pipeline 1 x tensor 2" in output
    # The slices of a checkpoint no longer kept go with it.
    assert sorted(path.name for path in (tmp_path / "straight").glob("ckpt-*")) == ["ckpt-12"]
    assert code != 0 and not (killed / "ckpt-12" / "index.json").exists(), output
    assert (killed / "ckpt-6" / "index.json").exists(), output
    code, output = horovodrun(2, *_command(tiny_data, killed, *tensor, "--resume",
                                           dropout="0.1"))
    assert code == 0, output
    assert "resumed from" in output and "next unseen batch" in output
    straight, resumed = (checkpoint_tensors(run_dir / "ckpt-12")
                         for run_dir in (tmp_path / "straight", killed))
    assert straight.keys() == resumed.keys()
    # Each slice's dropout states are its own: both ranks wrote theirs.
    assert any(key.endswith("/velocity") for key in straight)
    assert any(key.startswith("rng/") and key.endswith("@1") for key in straight)
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key], err_msg=key)
    straight_losses, resumed_losses = train_losses(tmp_path / "straight"), train_losses(killed)
    for at_step in (8, 10, 12):
        assert resumed_losses[at_step] == straight_losses[at_step], at_step




BATCH_CHECK = """
import tensorflow as tf
from tfgpt.config.distribution import HorovodOptions
from tfgpt.parallel.horovod_bridge import HorovodDistribution

distribution = HorovodDistribution.create(HorovodOptions(tensor_parallel=2))
rank = distribution.rank
# The same first batch on both ranks, then each rank a batch of its own.
batches = [(tf.constant([[1, 2, 3]]), tf.constant([[2, 3, 4]])),
           (tf.constant([[5, 6, 7]]) + rank, tf.constant([[6, 7, 8]]))]
try:
    for batch in distribution.one_batch_per_group(iter(batches), every_step=True):
        print(f"rank {rank} computes on", batch[0].numpy().tolist())
except ValueError as error:
    print(f"rank {rank} error: {error}")
"""


@pytest.mark.distributed
def test_two_ranks_of_a_tensor_group_on_different_batches_is_one_error_line(tmp_path):
    script = tmp_path / "batch_check.py"
    script.write_text(BATCH_CHECK)
    code, output = horovodrun(2, script)
    assert code == 0, output
    for rank in (0, 1):
        computed = [line.split(" computes on ")[1] for line in output.splitlines()
                    if f"rank {rank} computes on " in line]
        assert computed == ["[[1, 2, 3]]"], output
        [line] = [line for line in output.splitlines() if f"rank {rank} error:" in line]
        assert ("the ranks [0, 1] of one tensor group hold different batches at step 2 "
                "(fingerprints rank 0: ") in line and ", rank 1: " in line, line
