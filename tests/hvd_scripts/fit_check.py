"""Run under horovodrun: `model.fit` with different data per rank.

Usage: fit_check.py OUT {bridge,horovod-keras}

`bridge` trains with tfgpt.parallel.keras_horovod and writes
OUT/rank-R.npz with the weights after broadcast, after the first step and
at the end, this rank's own first-step gradients, the first step's learning
rate, and each epoch's logs before and after `AverageMetrics`. Rank 0 alone
writes TensorBoard and checkpoints under OUT/rank-0/.

`horovod-keras` documents Horovod's own Keras 3 integration: it records
whether `horovod.tensorflow.keras.DistributedOptimizer` can be built, trains
with it (after the same broadcast) and records the final weights, and calls
Horovod's Keras callbacks once, recording their errors.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.optim.schedules import WarmupDecay
from tfgpt.parallel import keras_horovod
from tfgpt.parallel.horovod_bridge import HorovodDistribution

VOCABULARY = 29
BATCH, SEQUENCE, STEPS_PER_EPOCH, EPOCHS = 3, 6, 4, 2


def tiny_gpt():
    return GPT(vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=8,
               intermediate_dim=12, max_sequence_length=8)


def rank_data(rank, batches, offset=0):
    rng = np.random.default_rng(1000 * offset + rank)  # different data per rank
    shape = (batches * BATCH, SEQUENCE)
    inputs = rng.integers(0, VOCABULARY, shape).astype("int32")
    targets = rng.integers(0, VOCABULARY, shape).astype("int32")
    return inputs, targets


def loss_function():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class RecordFirstStep(keras.callbacks.Callback):
    """After the broadcast: the weights, and this rank's gradients on batch 0."""

    def __init__(self, inputs, targets):
        super().__init__()
        self.inputs, self.targets = inputs, targets

    def on_train_begin(self, logs=None):
        variables = self.model.trainable_variables
        self.initial = [v.numpy() for v in variables]
        with tf.GradientTape() as tape:
            loss = loss_function()(self.targets, self.model(self.inputs, training=True))
        self.local_gradients = [
            tf.convert_to_tensor(g).numpy()
            for g in tape.gradient(loss, [v.value for v in variables])
        ]

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0 and not hasattr(self, "after_first"):
            self.after_first = [v.numpy() for v in self.model.trainable_variables]


class SnapshotLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def bridge(out, distribution):
    # Different seeds on purpose: the broadcast must make the start equal.
    keras.utils.set_random_seed(100 + distribution.rank)
    model = tiny_gpt()
    inputs, targets = rank_data(distribution.rank, STEPS_PER_EPOCH * EPOCHS)
    dataset = tf.data.Dataset.from_tensor_slices((inputs, targets)).batch(BATCH).repeat()
    validation = tf.data.Dataset.from_tensor_slices(
        rank_data(distribution.rank, 2, offset=1)).batch(BATCH)

    # Warmup and scaling by the schedule, as the module docstring says.
    schedule = WarmupDecay(0.5 * distribution.size, warmup_steps=4,
                           total_steps=STEPS_PER_EPOCH * EPOCHS)
    optimizer = keras_horovod.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=schedule), distribution)
    model.compile(optimizer=optimizer, loss=loss_function(), jit_compile=False)

    first = RecordFirstStep(inputs[:BATCH], targets[:BATCH])
    local, averaged = SnapshotLogs(), SnapshotLogs()
    rank_directory = os.path.join(out, f"rank-{distribution.rank}")
    writers = keras_horovod.rank_zero_only(
        [keras.callbacks.TensorBoard(os.path.join(rank_directory, "tensorboard")),
         keras.callbacks.ModelCheckpoint(os.path.join(rank_directory, "ckpt-{epoch}.weights.h5"),
                                         save_weights_only=True)],
        distribution)
    history = model.fit(
        dataset, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
        validation_data=validation, validation_steps=2, shuffle=False, verbose=0,
        callbacks=[keras_horovod.BroadcastInitialState(distribution), first, local,
                   keras_horovod.AverageMetrics(distribution), averaged, *writers])

    logs = {}
    for name, snapshots in (("local", local.epochs), ("averaged", averaged.epochs)):
        for key in ("loss", "val_loss"):
            logs[f"{name}_{key}"] = np.array([epoch[key] for epoch in snapshots])
    np.savez(
        os.path.join(out, f"rank-{distribution.rank}.npz"),
        first_learning_rate=float(schedule(0)),
        history_loss=np.array(history.history["loss"]),
        iterations=int(optimizer.iterations.numpy()),
        **logs,
        **{f"initial_{i}": v for i, v in enumerate(first.initial)},
        **{f"local_{i}": g for i, g in enumerate(first.local_gradients)},
        **{f"after_first_{i}": v for i, v in enumerate(first.after_first)},
        **{f"final_{i}": v.numpy() for i, v in enumerate(model.trainable_variables)},
    )


def horovod_keras(out, distribution):
    keras.utils.set_random_seed(100 + distribution.rank)
    model = tiny_gpt()
    results = {}
    try:
        import horovod.tensorflow.keras as hvd_keras

        optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    except Exception as error:  # recorded: the test documents either outcome
        results["construct_error"] = f"{type(error).__name__}: {error}"
    else:
        model.compile(optimizer=optimizer, loss=loss_function(), jit_compile=False)
        optimizer.build(model.trainable_variables)
        try:
            optimizer.variables
        except Exception as error:  # its `variables` calls Keras 2's variables()
            results["variables_error"] = f"{type(error).__name__}: {error}"
        # SGD without momentum has no slots: the model's variables are the state.
        distribution.broadcast_variables(model.variables)
        results.update({f"initial_{i}": v.numpy()
                        for i, v in enumerate(model.trainable_variables)})
        inputs, targets = rank_data(distribution.rank, STEPS_PER_EPOCH)
        model.fit(inputs, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        results.update({f"final_{i}": v.numpy()
                        for i, v in enumerate(model.trainable_variables)})

        # Horovod's Keras callbacks, each driven through the hooks it uses.
        probes = {
            "broadcast": (hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                          [("on_train_begin", ()), ("on_batch_end", (0, {}))]),
            "metric_average": (hvd_keras.callbacks.MetricAverageCallback(),
                               [("on_epoch_end", (0, {"loss": 1.0}))]),
            "learning_rate_warmup": (
                hvd_keras.callbacks.LearningRateWarmupCallback(
                    initial_lr=0.5, warmup_epochs=1, steps_per_epoch=STEPS_PER_EPOCH),
                [("on_train_begin", ()), ("on_epoch_begin", (0,)), ("on_batch_begin", (0,))]),
        }
        for name, (callback, calls) in probes.items():
            callback.set_model(model)
            try:
                for method, arguments in calls:
                    getattr(callback, method)(*arguments)
                results[f"callback_{name}"] = "ok"
            except Exception as error:
                results[f"callback_{name}"] = f"{type(error).__name__}: {error}"
    np.savez(os.path.join(out, f"rank-{distribution.rank}.npz"), **results)


def main(out, mode):
    distribution = HorovodDistribution()
    distribution.configure_devices()
    {"bridge": bridge, "horovod-keras": horovod_keras}[mode](out, distribution)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
