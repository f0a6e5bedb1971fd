"""Run under horovodrun: each rank trains on different data; weights must stay equal.

Writes each rank's final weights to OUT/rank-R.npz and its first-step
gradients (before averaging) so the test can check the averaging against
NumPy; and the weights after a loss weighted per token, each rank holding
a different number of learned tokens (`weighted_training`, which the test
runs in one process on the global batch as the oracle). Usage:
train_step_check.py OUT [--xla]
"""

import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.parallel import LocalDistribution
from tfgpt.parallel.horovod_bridge import HorovodDistribution
from tfgpt.training.train_step import TrainStep, cross_entropy

# Small enough that this model's gradients make several buckets, which the
# train step below uses too.
BUCKET_BYTES = 600


def weighted_batches(steps=2):
    """`steps` global batches of 4 rows, `(inputs, targets, weights)`: rows 0-1
    (rank 0's) learn 11 of their 12 targets, rows 2-3 (rank 1's) only 2."""
    rng = np.random.default_rng(5)
    weights = np.zeros((4, 6), "float32")
    weights[:2] = 1.0
    weights[0, 0] = 0.0
    weights[2, 5] = weights[3, 1] = 1.0
    return [(rng.integers(0, 29, (4, 6)).astype("int32"),
             rng.integers(0, 29, (4, 6)).astype("int32"), weights) for _ in range(steps)]


def weighted_loss(model, batch, training):
    inputs, targets, weights = batch
    return cross_entropy(targets, model(inputs, training=training), weights), {}


def weighted_training(distribution, rows, accumulation_steps=1, towers=1, global_mean=True):
    """Final weights and losses of 2 SGD steps on the weighted loss, reading
    `rows` of each global batch (as `accumulation_steps` micro-batches);
    `global_mean` False: each part's own weighted mean, averaged."""
    keras.utils.set_random_seed(11)
    model = GPT(vocabulary_size=29, num_layers=2, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8)
    optimizer = keras.optimizers.SGD(learning_rate=0.5)
    optimizer.build(model.trainable_variables)
    step = TrainStep(model, optimizer, distribution, loss_fn=weighted_loss,
                     accumulation_steps=accumulation_steps, towers=towers,
                     token_weights=(lambda batch: batch[2]) if global_mean else None)
    losses = []
    for batch in weighted_batches():
        part = tuple(leaf[rows] for leaf in batch)
        if accumulation_steps > 1:
            part = tuple(leaf.reshape((accumulation_steps, -1) + leaf.shape[1:]) for leaf in part)
        losses.append(float(step(part)["loss"]))
    return [v.numpy() for v in model.trainable_variables], losses


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
    # Each rank its two rows of the weighted batches, one micro-batch each.
    rank = distribution.rank
    weighted, weighted_losses = weighted_training(distribution, slice(2 * rank, 2 * rank + 2),
                                                  accumulation_steps=2)
    naive, _ = weighted_training(distribution, slice(2 * rank, 2 * rank + 2),
                                 accumulation_steps=2, global_mean=False)
    # One process on all 4 rows: whole (the oracle), as 2 micro-batches, in 2 towers.
    one = {name: weighted_training(LocalDistribution(), slice(0, 4), **options)
           for name, options in (("whole", {}), ("accumulated", {"accumulation_steps": 2}),
                                 ("towers", {"towers": 2}))}
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
        **{f"weighted_{i}": v for i, v in enumerate(weighted)},
        **{f"naive_{i}": v for i, v in enumerate(naive)},
        weighted_losses=np.array(
            [float(distribution.allreduce_mean(loss)) for loss in weighted_losses]),
        **{f"{name}_{i}": v for name, (weights, _) in one.items() for i, v in enumerate(weights)},
        **{f"{name}_losses": np.array(losses) for name, (_, losses) in one.items()},
    )


if __name__ == "__main__":
    main(sys.argv[1], "--xla" in sys.argv[2:])
