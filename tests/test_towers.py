"""Towers: slices of a batch computed side by side in one step
(`TrainStep(towers=K)`, `tfgpt.parallel.cpu_threads`)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config import TrainConfig
from tfgpt.finetuning import FinetuneConfig
from tfgpt.parallel import LocalDistribution
from tfgpt.parallel.cpu_threads import resolve_towers
from tfgpt.training.train_step import TrainStep, cross_entropy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNING_RATE = 0.1


def _tiny_gpt():
    keras.utils.set_random_seed(5)
    return GPT(vocabulary_size=29, num_layers=3, num_heads=2, hidden_dim=8,
               intermediate_dim=12, max_sequence_length=8)


def _sgd_step(batch, loss_fn=None, **step_options):
    """Weights after one plain SGD step, and the step's metrics."""
    model = _tiny_gpt()
    optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
    optimizer.build(model.trainable_variables)
    options = {"loss_fn": loss_fn} if loss_fn else {}
    step = TrainStep(model, optimizer, LocalDistribution(), **options, **step_options)
    metrics = step(batch)
    return [v.numpy() for v in model.trainable_variables], metrics


def _gradients(loss_of_model):
    """Gradients of `loss_of_model(model)` at the initial weights, by a plain tape."""
    model = _tiny_gpt()
    model(tf.zeros([1, 1], "int32"))  # build
    with tf.GradientTape() as tape:
        loss = loss_of_model(model)
    gradients = tape.gradient(loss, model.trainable_variables)
    initial = [v.numpy() for v in model.trainable_variables]
    return initial, [tf.convert_to_tensor(g).numpy() for g in gradients], float(loss)


@pytest.mark.parametrize("towers", [2, 3])
def test_towers_give_the_whole_batch_gradients_of_a_causal_lm(towers):
    rng = np.random.default_rng(7)
    inputs = rng.integers(0, 29, (6, 5)).astype("int32")
    targets = rng.integers(0, 29, (6, 5)).astype("int32")
    # Oracle: one tape over the whole batch, outside TrainStep.
    initial, gradients, loss = _gradients(
        lambda model: cross_entropy(targets, model(inputs, training=True)))

    weights, metrics = _sgd_step((inputs, targets), towers=towers)

    assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-6)
    for before, gradient, after in zip(initial, gradients, weights):
        np.testing.assert_allclose(after, before - LEARNING_RATE * gradient, atol=1e-6)
    # The step moved the weights: the comparison is not between two no-ops.
    assert max(np.abs(a - b).max() for a, b in zip(initial, weights)) > 1e-3


def test_a_weighted_loss_is_averaged_per_slice_and_dict_batches_are_sliced():
    """A masked mean is taken per slice, then the slices' losses averaged
    (as across workers); every leaf of a nested batch is cut alike."""
    rng = np.random.default_rng(3)
    batch = {
        "inputs": rng.integers(0, 29, (4, 5)).astype("int32"),
        "targets": rng.integers(0, 29, (4, 5)).astype("int32"),
        # Unequal weight totals per slice, so per-slice means differ from
        # the whole batch's weighted mean.
        "weights": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0],
                             [1, 0, 0, 0, 0], [0, 0, 1, 0, 0]], "float32"),
    }

    def loss_fn(model, batch, training):
        logits = model(batch["inputs"], training=training)
        loss = cross_entropy(batch["targets"], logits, batch["weights"])
        return loss, {"weight_total": tf.reduce_sum(batch["weights"])}

    def slice_loss(model, rows):
        part = {key: value[rows] for key, value in batch.items()}
        return loss_fn(model, part, True)[0]

    initial, gradients, loss = _gradients(
        lambda model: (slice_loss(model, slice(0, 2)) + slice_loss(model, slice(2, 4))) / 2)
    _, _, whole_loss = _gradients(lambda model: loss_fn(model, batch, True)[0])
    assert abs(loss - whole_loss) > 1e-3  # the two definitions do differ here

    weights, metrics = _sgd_step(batch, loss_fn=loss_fn, towers=2)

    assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-6)
    assert float(metrics["weight_total"]) == pytest.approx((9 + 2) / 2)
    for before, gradient, after in zip(initial, gradients, weights):
        np.testing.assert_allclose(after, before - LEARNING_RATE * gradient, atol=1e-6)


def test_towers_with_accumulation_equal_one_large_batch():
    rng = np.random.default_rng(11)
    inputs = rng.integers(0, 29, (2, 4, 5)).astype("int32")  # 2 micro-batches of 4
    targets = rng.integers(0, 29, (2, 4, 5)).astype("int32")
    initial, gradients, _ = _gradients(lambda model: cross_entropy(
        targets.reshape(8, 5), model(inputs.reshape(8, 5), training=True)))

    weights, _ = _sgd_step((inputs, targets), towers=2, accumulation_steps=2)

    for before, gradient, after in zip(initial, gradients, weights):
        np.testing.assert_allclose(after, before - LEARNING_RATE * gradient, atol=1e-6)


@pytest.mark.parametrize("towers", [0, -1, 1.5, True])
def test_train_step_refuses_a_bad_tower_count(towers):
    with pytest.raises(ValueError, match="`towers` must be a positive integer"):
        TrainStep(_tiny_gpt(), keras.optimizers.SGD(), LocalDistribution(), towers=towers)


def test_train_config_refuses_towers_that_do_not_divide_the_batch():
    with pytest.raises(ValueError, match="`batch_size` must be divisible by `towers`.*"
                                         "batch_size=6, towers=4"):
        TrainConfig(data="d", batch_size=6, towers=4)
    with pytest.raises(ValueError, match="`towers` must be a non-negative integer"):
        TrainConfig(data="d", towers=-2)
    with pytest.raises(ValueError, match="batch_size=10, towers=3"):
        FinetuneConfig(train_file="t.tsv", tokenizer="s.model", batch_size=10, towers=3)


@pytest.mark.parametrize("options, expected", [
    (dict(threads=2, batch_size=8), 2),
    (dict(threads=4, batch_size=6), 2),
    (dict(threads=1, batch_size=8), 1),       # nothing to split
    (dict(threads=2, batch_size=7), 1),       # odd batch
    (dict(threads=2, batch_size=0), 1),       # batch unknown (model.fit, notebooks)
    (dict(threads=2, batch_size=8, xla=True), 1),     # an XLA cluster runs ops in turn
    (dict(threads=2, batch_size=8, replicas=2), 1),   # --logical-cpus replicas already split
    (dict(threads=2, batch_size=8, gpu=True), 1),
])
def test_zero_towers_chooses_two_only_for_a_multithreaded_cpu_worker(options, expected):
    options.setdefault("gpu", False)
    assert resolve_towers(0, **options) == expected
    # An explicit count is kept as asked.
    assert resolve_towers(3, **options) == 3


def test_resolve_towers_refuses_a_negative_count():
    with pytest.raises(ValueError, match="towers=-1"):
        resolve_towers(-1, threads=2)


_THREADS_SCRIPT = """
import json, sys
import tensorflow as tf
from tfgpt.parallel.cpu_threads import configure_cpu_threads
configure_cpu_threads(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
print(json.dumps([tf.config.threading.get_intra_op_parallelism_threads(),
                  tf.config.threading.get_inter_op_parallelism_threads()]))
"""


@pytest.mark.parametrize("threads, towers, inter, expected", [
    (2, 2, 2, [1, 2]),
    (4, 2, 1, [2, 2]),      # at least one op per tower at once
    (2, 1, 2, [2, 2]),
    (2, 1, None, [2, 0]),   # one tower: TensorFlow's default inter-op pool
    (3, 2, None, [1, 2]),
])
def test_threads_are_split_among_the_towers(threads, towers, inter, expected):
    # A fresh process: TensorFlow's pools are fixed once it has run an op.
    output = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT, str(threads), str(towers), json.dumps(inter)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True, text=True, check=True,
    ).stdout
    assert json.loads(output.strip().splitlines()[-1]) == expected


@pytest.mark.slow
def test_the_trainer_with_two_towers_records_them_and_follows_the_one_tower_run(tiny_data, tmp_path):
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.trainer import train

    losses = {}
    for towers in (1, 2):
        out = tmp_path / f"towers{towers}"
        config, overrides = parse_flags([
            "--data", str(tiny_data), "--out", str(out), "--steps", "4", "--log-every", "1",
            "--batch-size", "4", "--towers", str(towers), "--eval-batches", "1",
            "--peak-flops", "1e10", "--num-layers", "2", "--num-heads", "2",
            "--hidden-dim", "16", "--intermediate-dim", "24", "--max-sequence-length", "16",
        ])
        train(config, overrides, LocalDistribution())
        with open(out / "metrics.jsonl") as file:
            records = [json.loads(line) for line in file]
        losses[towers] = [r["loss"] for r in records if r.get("split") == "train" and "loss" in r]
        assert json.loads((out / "config.json").read_text())["train"]["towers"] == towers
    assert len(losses[1]) == 4
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5)
    assert losses[1][-1] < losses[1][0]  # it trained
