"""Training core: flags, schedule, optimizer, train step (single process)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config import TrainConfig
from tfgpt.distributed import LocalDistribution
from tfgpt.training.flags import parse_flags
from tfgpt.training.optimizers import make_optimizer
from tfgpt.training.schedules import WarmupDecay
from tfgpt.training.train_step import TrainStep, cross_entropy

# ---- Flags --------------------------------------------------------------


def test_flags_apply_preset_then_overrides():
    train_config, overrides = parse_flags(
        ["--data", "d", "--preset", "gpt-mini", "--batch-size", "3", "--num-layers", "2",
         "--no-tie-embeddings", "--xla"]
    )
    assert train_config.batch_size == 3 and train_config.xla is True
    assert train_config.preset == "gpt-mini"
    assert overrides == {"num_layers": 2, "tie_embeddings": False}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "d", "--batch-sise", "3"], "unrecognized arguments: --batch-sise"),
        (["--data", "d", "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["--data", "d", "--preset", "gpt5"], "preset='gpt5'"),
        (["--data", "d", "--hidden-dim", "10", "--num-heads", "4"], "hidden_dim=10, num_heads=4"),
        (["--data", "d", "--mixed-precision", "fp8"], "mixed_precision='fp8'"),
        (["--data", "d", "--batch-size", "0"], "batch_size=0"),
        ([], "`data` is required"),
    ],
)
def test_bad_flags_exit_with_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_flags(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


# ---- Schedule and optimizer ---------------------------------------------


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_schedule_matches_closed_form(decay):
    peak, warmup, total, floor = 3e-3, 7, 50, 0.1
    schedule = WarmupDecay(peak, warmup, total, decay=decay, final_ratio=floor)
    for step in [0, 3, 6, 7, 20, 49, 50, 80]:
        if step < warmup:
            expected = peak * (step + 1) / warmup
        else:
            progress = min((step - warmup) / (total - warmup), 1.0)
            shape = {
                "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
                "linear": 1 - progress,
                "constant": 1.0,
            }[decay]
            expected = peak * (floor + (1 - floor) * shape)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5), step


def test_learning_rate_scales_with_workers():
    config = TrainConfig(data="d", learning_rate=1e-3, warmup_steps=0, schedule="constant")
    assert float(make_optimizer(config, num_workers=4).learning_rate) == pytest.approx(4e-3)
    config = TrainConfig(
        data="d", learning_rate=1e-3, warmup_steps=0, schedule="constant",
        scale_learning_rate=False,
    )
    assert float(make_optimizer(config, num_workers=4).learning_rate) == pytest.approx(1e-3)


def test_weight_decay_skips_norms_biases_and_embeddings():
    model = GPT(vocabulary_size=31, num_layers=2, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8)
    optimizer = make_optimizer(TrainConfig(data="d"))
    decayed = {v.path for v in model.trainable_variables if optimizer._use_weight_decay(v)}
    assert decayed == {v.path for v in model.trainable_variables if v.name == "kernel"}
    assert len(decayed) == 2 * 4


# ---- Train step ---------------------------------------------------------


def test_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype("float32")
    targets = rng.integers(0, 7, (2, 5))
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    assert float(cross_entropy(targets, logits)) == pytest.approx(expected, rel=1e-5)


class HalvingDistribution(LocalDistribution):
    """Pretends a second worker sent zero gradients: the average halves them."""

    def allreduce_gradients(self, gradients):
        return [g / 2 for g in gradients]


@pytest.mark.parametrize("xla", [False, True])
def test_train_step_applies_the_averaged_gradients(xla):
    """One SGD-like step with the step's own gradients equals a manual update,
    and the distribution's averaging is applied to what the optimizer sees."""
    import keras

    def build():
        keras.utils.set_random_seed(3)
        return GPT(vocabulary_size=23, num_layers=2, num_heads=2, hidden_dim=8,
                   intermediate_dim=12, max_sequence_length=8)

    rng = np.random.default_rng(1)
    inputs = rng.integers(0, 23, (3, 5)).astype("int32")
    targets = rng.integers(0, 23, (3, 5)).astype("int32")

    model = build()
    with tf.GradientTape() as tape:
        loss = cross_entropy(targets, model(inputs, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    expected = [
        v.numpy() - 0.1 * tf.convert_to_tensor(g).numpy() / 2
        for v, g in zip(model.trainable_variables, gradients)
    ]

    model = build()
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    step = TrainStep(model, optimizer, HalvingDistribution(), xla=xla)
    step_loss = step(inputs, targets)["loss"]
    assert float(step_loss) == pytest.approx(float(loss), rel=1e-5)
    for variable, value in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(variable.numpy(), value, atol=1e-6, err_msg=variable.path)
