"""`train_hvd.py --tensor-parallel`: refusals, checkpoints, resuming on the same and other layouts."""

import json
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

from tests.launch import REPO, horovodrun, run, train_losses
from tfgpt.config import GPTConfig
from tfgpt.config.training import TrainConfig

TINY_MODEL = [
    "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]


# ---- Refusals: one line each, before any compute -------------------------------------


def _check(tensor=2, family="gpt", zero_stage=0, model=None, **train):
    from tfgpt.distributed.tensor_parallel import check_run

    model_config = GPTConfig(**{"vocabulary_size": 300, "num_heads": 2, "hidden_dim": 32,
                                "intermediate_dim": 48, **(model or {})})
    check_run(tensor, family, model_config, TrainConfig(data="d", **train), zero_stage)


@pytest.mark.parametrize("model, match", [
    ({"num_heads": 1, "hidden_dim": 32},
     r"--tensor-parallel 2 must divide `num_heads`. Received: num_heads=1"),
    ({"intermediate_dim": 47},
     r"--tensor-parallel 2 must divide `intermediate_dim`. Received: intermediate_dim=47"),
    ({"vocabulary_size": 301},
     r"must divide `vocabulary_size`. Received: vocabulary_size=301.*--vocabulary-size 302"),
])
def test_a_size_the_tensor_parallel_degree_does_not_divide_is_refused(model, match):
    with pytest.raises(ValueError, match=match):
        _check(model=model)


@pytest.mark.parametrize("family", ["bert", "albert"])
def test_encoders_are_refused(family):
    with pytest.raises(ValueError, match=rf"splits GPT models only; --preset .* is a {family}"):
        _check(family=family)


@pytest.mark.parametrize("train, zero_stage, flag", [
    ({"xla": True}, 0, "--xla"), ({"recompute": True}, 0, "--recompute"),
    ({"optimizer": "lamb"}, 0, "--optimizer lamb"),
    ({"mixed_precision": "float16"}, 0, "--mixed-precision float16"),
])
def test_options_not_combined_with_tensor_parallelism_are_refused(train, zero_stage, flag):
    with pytest.raises(ValueError, match=f"--tensor-parallel 2 does not combine with {flag} yet"):
        _check(zero_stage=zero_stage, **train)
    _check(tensor=1, zero_stage=zero_stage, **train)  # nothing to refuse without it


def test_the_option_must_be_a_positive_integer():
    from tfgpt.config.distribution import HorovodOptions

    with pytest.raises(ValueError, match="`tensor_parallel` must be a positive integer. "
                                         "Received: tensor_parallel=0"):
        HorovodOptions(tensor_parallel=0)


def test_fine_tuning_refuses_tensor_parallelism():
    from tfgpt.config.finetuning import FinetuneConfig
    from tfgpt.finetuning.finetuner import finetune

    distribution = types.SimpleNamespace(tensor_slice=types.SimpleNamespace(size=2), options=None)
    config = FinetuneConfig.__new__(FinetuneConfig)  # never read: refused first
    with pytest.raises(ValueError, match=r"--tensor-parallel 2 splits GPT pretraining "
                                         r"\(train_hvd.py\) only"):
        finetune(config, {}, distribution)


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


def _tensors(prefix):
    checkpoint = tf.train.load_checkpoint(str(prefix))
    return {name: checkpoint.get_tensor(name) for name in checkpoint.get_variable_to_shape_map()
            if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_and_resume_on_the_same_layout_is_bitwise(tiny_data, tmp_path):
    tensor = ["--tensor-parallel", "2"]
    code, output = horovodrun(2, *_command(tiny_data, tmp_path / "straight", *tensor,
                                           "--keep-checkpoints", "1", dropout="0.1"))
    assert code == 0, output
    assert "layout: 2 rank(s) = data 1 x pipeline 1 x tensor 2" in output
    # The slices of a checkpoint no longer kept go with it.
    assert sorted(path.name for path in (tmp_path / "straight" / "tensor").iterdir()) == [
        "ckpt-12"]
    killed = tmp_path / "killed"
    code, output = horovodrun(2, *_command(tiny_data, killed, *tensor, dropout="0.1"),
                              env={"TFGPT_FAULT_KILL_AFTER_SAVE": "6"})
    assert code != 0 and not (killed / "ckpt-12.index").exists(), output
    code, output = horovodrun(2, *_command(tiny_data, killed, *tensor, "--resume",
                                           dropout="0.1"))
    assert code == 0, output
    assert "resumed from" in output and "next unseen batch" in output
    for index in range(2):
        name = f"tensor/ckpt-12/slice-{index:03d}-of-002"
        straight, resumed = _tensors(tmp_path / "straight" / name), _tensors(killed / name)
        assert straight.keys() == resumed.keys()
        assert any("optimizer" in key for key in straight) and any("rng" in key for key in straight)
        for key in straight:
            np.testing.assert_array_equal(straight[key], resumed[key], err_msg=f"{name} {key}")
    straight_losses, resumed_losses = train_losses(tmp_path / "straight"), train_losses(killed)
    for at_step in (8, 10, 12):
        assert resumed_losses[at_step] == straight_losses[at_step], at_step


@pytest.mark.distributed
@pytest.mark.slow
def test_a_layout_merged_and_split_resumes_on_another_with_the_same_losses(tiny_data, tmp_path,
                                                                           capsys):
    from tfgpt.loading import load_model
    from tfgpt.training import tensor_checkpoint

    tensor = ["--tensor-parallel", "2"]
    code, output = horovodrun(2, *_command(tiny_data, tmp_path / "straight", *tensor))
    assert code == 0, output
    expected = train_losses(tmp_path / "straight")
    killed = tmp_path / "killed"
    code, output = horovodrun(2, *_command(tiny_data, killed, *tensor),
                              env={"TFGPT_FAULT_KILL_AFTER_SAVE": "6"})
    assert code != 0, output

    # TP2 -> the ordinary checkpoint -> one process.
    code, output = run([sys.executable, "-m", "tfgpt.training.tensor_checkpoint", "merge",
                        killed, tmp_path / "merged"])
    assert code == 0 and "wrote" in output and "ckpt-6" in output, output
    assert json.loads((tmp_path / "merged" / "config.json").read_text())[
        "train"]["tensor_parallel"] == 1
    # The ordinary checkpoint -> TP2 again (before the merged run resumes from it),
    # in this process: the command line is the merge's above.
    tensor_checkpoint.main(["split", str(tmp_path / "merged"), str(tmp_path / "split"),
                            "--tensor-parallel", "2"])
    written = capsys.readouterr().out
    assert written.startswith(f"wrote {tmp_path / 'split'}") and "ckpt-6" in written, written
    # The ordinary checkpoint refuses to be read as slices, naming the tool.
    code, output = horovodrun(2, *_command(tiny_data, tmp_path / "merged", *tensor, "--resume"))
    assert code != 0 and "was written by a whole model" in output
    assert "tensor_checkpoint split RUN OUT --tensor-parallel 2" in output
    code, output = run([sys.executable, *_command(tiny_data, tmp_path / "merged", "--resume")])
    assert code == 0, output
    assert "next unseen batch" in output

    code, output = horovodrun(2, *_command(tiny_data, tmp_path / "split", *tensor, "--resume"))
    assert code == 0, output
    for other in ("merged", "split"):
        losses = train_losses(tmp_path / other)
        for at_step in (8, 10, 12):
            assert losses[at_step] == pytest.approx(expected[at_step], abs=1e-5), (other, at_step)

    with pytest.raises(ValueError, match="is an ordinary checkpoint already: nothing to merge"):
        tensor_checkpoint.merge(str(tmp_path / "merged"), str(tmp_path / "again"))
    with pytest.raises(ValueError, match=r"was written by --tensor-parallel 2; this run is "
                                         r"whole: convert it first with .* merge RUN OUT"):
        tensor_checkpoint.split(str(tmp_path / "straight"), str(tmp_path / "again"), 2)

    # The loader reads a tensor-parallel run whole: the same weights as its merge.
    whole, _ = load_model(str(tmp_path / "straight"))
    tensor_checkpoint.merge(str(tmp_path / "straight"), str(tmp_path / "straight-merged"))
    merged, _ = load_model(str(tmp_path / "straight-merged"))
    for a, b in zip(whole.trainable_variables, merged.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert len(whole.generate([[5, 6, 7]], max_new_tokens=3)[0]) == 3
