"""FusedAdamW under MirroredStrategy with two logical CPUs, against Keras AdamW.

Prints "replicas identical, equal to keras AdamW" when every replica's copy
of the weights and optimizer variables equals the other's, and the weights
equal those Keras's AdamW reaches under the same strategy.
"""

import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config import TrainConfig
from tfgpt.config.distribution import StrategyOptions
from tfgpt.optim.optimizers import (
    NO_DECAY_PATTERN,
    learning_rate_schedule,
    make_optimizer,
)
from tfgpt.parallel.strategy import StrategyDistribution
from tfgpt.training.train_step import TrainStep


def train(distribution, fused, batches):
    config = TrainConfig(data="d", warmup_steps=2, steps=10, gradient_clip_norm=0.5)
    with distribution.strategy.scope():
        keras.utils.set_random_seed(3)
        model = GPT(vocabulary_size=23, num_layers=3, num_heads=2, hidden_dim=8,
                    intermediate_dim=12, max_sequence_length=8)
        if fused:
            optimizer = make_optimizer(config)
        else:
            optimizer = keras.optimizers.AdamW(
                learning_rate=learning_rate_schedule(config), weight_decay=config.weight_decay,
                global_clipnorm=config.gradient_clip_norm, beta_1=0.9, beta_2=0.95, epsilon=1e-8)
            optimizer.exclude_from_weight_decay(var_names=[NO_DECAY_PATTERN])
        optimizer.build(model.trainable_variables)
    assert type(optimizer).__name__ == ("FusedAdamW" if fused else "AdamW")
    step = TrainStep(model, optimizer, distribution)
    for batch in batches:
        dataset = tf.data.Dataset.from_tensors(batch).unbatch().batch(4)
        step(next(iter(distribution.strategy.experimental_distribute_dataset(dataset))))
    return ([v.value for v in model.trainable_variables], [v.value for v in optimizer.variables],
            int(optimizer.iterations.value.numpy()))


def main():
    distribution = StrategyDistribution.create(StrategyOptions("mirrored", logical_cpus=2))
    assert distribution.size == 2, distribution.size
    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, 23, (4, 5)).astype("int32"),
                rng.integers(0, 23, (4, 5)).astype("int32")) for _ in range(3)]
    weights, slots, steps = train(distribution, True, batches)
    reference, _, reference_steps = train(distribution, False, batches)
    assert steps == reference_steps == 3, (steps, reference_steps)
    for variable in weights + slots:
        copies = [c.numpy() for c in variable.values]
        assert len(copies) == 2, variable.name
        np.testing.assert_array_equal(copies[0], copies[1], err_msg=variable.name)
    # As in tests/test_fused_adamw.py's TrainStep comparison.
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a.values[0].numpy(), b.values[0].numpy(), atol=2e-6,
                                   err_msg=a.name)
    print("replicas identical, equal to keras AdamW")


if __name__ == "__main__":
    main()
