"""Run under horovodrun: each rank trains on different data; weights must stay equal.

Writes each rank's final weights to OUT/rank-R.npz and its first-step
gradients (before averaging) so the test can check the averaging against
NumPy. Usage: train_step_check.py OUT [--xla]
"""

import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.parallel.horovod_bridge import HorovodDistribution
from tfgpt.training.train_step import TrainStep, cross_entropy

# Small enough that this model's gradients make several buckets, which the
# train step below uses too.
BUCKET_BYTES = 600


def main(out, xla):
    distribution = HorovodDistribution()
    distribution.configure_devices()
    # Different seeds on purpose: the broadcast must make the start equal.
    keras.utils.set_random_seed(100 + distribution.rank)
    model = GPT(vocabulary_size=29, num_layers=2, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8)
    optimizer = keras.optimizers.Adam(learning_rate=0.01)
    optimizer.build(model.trainable_variables)
    distribution.broadcast_variables(model.variables + optimizer.variables)
    initial = [v.numpy() for v in model.trainable_variables]

    rng = np.random.default_rng(distribution.rank)  # different data per rank
    batches = [(rng.integers(0, 29, (3, 6)).astype("int32"),
                rng.integers(0, 29, (3, 6)).astype("int32")) for _ in range(4)]
    inputs, targets = batches[0]
    with tf.GradientTape() as tape:
        loss = cross_entropy(targets, model(inputs, training=True))
    local_gradients = [tf.convert_to_tensor(g).numpy()
                       for g in tape.gradient(loss, model.trainable_variables)]
    averaged = [g.numpy() for g in distribution.allreduce_gradients(
        [tf.constant(g) for g in local_gradients])]
    # In a graph, as TrainStep runs it: one allreduce per gradient, and
    # several buckets of gradients (this model's gradients are ~100-2,000
    # bytes each), against Horovod's one grouped allreduce of them all.
    constants = [tf.constant(g) for g in local_gradients]
    distribution.bucket_bytes = 0
    per_gradient = tf.function(distribution.allreduce_gradients)(constants)
    distribution.bucket_bytes = BUCKET_BYTES
    bucketed = tf.function(distribution.allreduce_gradients)(constants)
    grouped = tf.function(lambda gradients: hvd.grouped_allreduce(gradients, op=hvd.Average))(
        constants)

    step = TrainStep(model, optimizer, distribution, xla=xla)
    losses = [float(step(x, y)["loss"]) for x, y in batches]
    np.savez(
        f"{out}/rank-{distribution.rank}.npz",
        losses=np.array(losses),
        **{f"initial_{i}": v for i, v in enumerate(initial)},
        **{f"local_{i}": g for i, g in enumerate(local_gradients)},
        **{f"averaged_{i}": g for i, g in enumerate(averaged)},
        **{f"graph_averaged_{i}": g.numpy() for i, g in enumerate(per_gradient)},
        **{f"grouped_averaged_{i}": g.numpy() for i, g in enumerate(grouped)},
        **{f"bucketed_averaged_{i}": g.numpy() for i, g in enumerate(bucketed)},
        **{f"final_{i}": v.numpy() for i, v in enumerate(model.trainable_variables)},
    )


if __name__ == "__main__":
    main(sys.argv[1], "--xla" in sys.argv[2:])
