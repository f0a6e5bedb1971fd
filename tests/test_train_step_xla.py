"""What XLA compiles in a TrainStep, and that it changes no numbers beyond rounding."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config import TrainConfig
from tfgpt.optim.optimizers import make_optimizer
from tfgpt.parallel import LocalDistribution
from tfgpt.parallel.strategy import StrategyDistribution
from tfgpt.training.train_step import TrainStep


class AveragingElsewhere(LocalDistribution):
    """Stands for Horovod: an allreduce XLA must not compile (here a no-op)."""

    def allreduce_gradients(self, gradients):
        return list(gradients)


def _train(distribution, xla, accumulation_steps=1, precision="float32"):
    keras.utils.set_random_seed(4)
    model = GPT(vocabulary_size=29, num_layers=3, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8, dtype=precision)
    config = TrainConfig(data="d", warmup_steps=0, gradient_clip_norm=0.5,
                         mixed_precision="off" if precision == "float32" else "bfloat16")
    optimizer = make_optimizer(config)
    optimizer.build(model.trainable_variables)
    step = TrainStep(model, optimizer, distribution, xla=xla,
                     accumulation_steps=accumulation_steps)
    rng = np.random.default_rng(6)
    shape = (accumulation_steps, 2, 5) if accumulation_steps > 1 else (2, 5)
    losses = []
    for _ in range(3):
        batch = (rng.integers(0, 29, shape).astype("int32"), rng.integers(0, 29, shape).astype("int32"))
        losses.append(float(step(batch)["loss"]))
    return step, losses, [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("distribution", [LocalDistribution, AveragingElsewhere])
def test_xla_steps_equal_graph_steps(distribution, accumulation_steps):
    step, losses, weights = _train(distribution(), True, accumulation_steps)
    expected = ("step",) if distribution is LocalDistribution else ("compute", "update")
    assert step.compiled == expected
    graph_step, graph_losses, graph_weights = _train(distribution(), False, accumulation_steps)
    assert graph_step.compiled == ()
    np.testing.assert_allclose(losses, graph_losses, rtol=1e-5)
    for a, b in zip(weights, graph_weights):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_whole_step_xla_under_mixed_bfloat16_keeps_float32_weights():
    try:
        step, losses, weights = _train(LocalDistribution(), True, precision="mixed_bfloat16")
    finally:
        keras.config.set_dtype_policy("float32")
    assert step.compiled == ("step",)
    assert np.isfinite(losses).all() and all(w.dtype == np.float32 for w in weights)


def test_strategies_compile_the_gradients_only():
    # Keras updates through merge_call under a strategy, which XLA cannot hold.
    strategy = StrategyDistribution(tf.distribute.get_strategy())
    model = GPT(vocabulary_size=29, num_layers=1, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8)
    step = TrainStep(model, keras.optimizers.SGD(0.1), strategy, xla=True)
    assert step.compiled == ("compute",)
    assert TrainStep(model, keras.optimizers.SGD(0.1), strategy, xla=False).compiled == ()
