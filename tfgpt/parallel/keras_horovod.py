"""Horovod under `model.fit` on Keras 3: optimizer wrapper and callbacks.

Horovod 0.28.1's own Keras integration predates Keras 3 and is not usable:

- `horovod.tensorflow.keras.DistributedOptimizer` constructs and trains
  without an error, but averages nothing: it averages in `get_gradients` /
  `_aggregate_gradients`, which Keras 3's `train_step` never calls (it calls
  `apply_gradients` straight away). Every rank follows its own gradients
  and the weights drift apart silently.
- Its callbacks fail on first use: `BroadcastGlobalVariablesCallback` calls
  `Variable.ref()`, `MetricAverageCallback` calls `keras.backend.constant`
  and `LearningRateWarmupCallback` `keras.backend.get_value`, none of which
  Keras 3 has.

This module replaces all of them, using only `horovod.tensorflow` through a
`tfgpt.parallel` distribution object (`HorovodDistribution` by default):

    import keras
    from tfgpt.parallel.horovod_bridge import HorovodDistribution
    from tfgpt.parallel import keras_horovod
    from tfgpt.optim.schedules import WarmupDecay

    distribution = HorovodDistribution()          # hvd.init()
    distribution.configure_devices()
    schedule = WarmupDecay(3e-4 * distribution.size, warmup_steps=200, total_steps=5000)
    optimizer = keras_horovod.DistributedOptimizer(
        keras.optimizers.AdamW(schedule), distribution
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,                        # see "XLA" below
    )
    model.fit(
        dataset,                                  # this rank's shard, .repeat()ed
        steps_per_epoch=steps,                    # the same on every rank
        verbose=1 if distribution.is_chief else 0,
        callbacks=[
            keras_horovod.BroadcastInitialState(distribution),
            keras_horovod.AverageMetrics(distribution),
            *keras_horovod.rank_zero_only(
                [keras.callbacks.TensorBoard("runs/x/tensorboard"),
                 keras.callbacks.ModelCheckpoint("runs/x/ckpt-{epoch}.weights.h5",
                                                 save_weights_only=True)],
                distribution,
            ),
        ],
    )

XLA: a Horovod allreduce cannot run inside an XLA cluster (this build of
Horovod has no XLA kernels; TensorFlow reports "No registered
'HorovodAllreduce' OpKernel for XLA_CPU_JIT"). Under `model.fit` the whole
train step, optimizer update included, is one `tf.function` that
`jit_compile=True` compiles as one cluster, so the averaging cannot be moved
out of it from the optimizer. The model must therefore be compiled with
`jit_compile=False`. `compile()`'s default `"auto"` is False on CPU-only
machines but True with a GPU, so pass `jit_compile=False` explicitly. If the
train step is jit-compiled anyway, `BroadcastInitialState` raises a
`ValueError` before the first step, and `DistributedOptimizer` raises the
same error while the step is traced (a custom loop without the callback).
For an XLA-compiled forward/backward pass with Horovod, use the custom
trainer (`train_hvd.py --xla`), which compiles the gradient computation and
averages outside the cluster.

Learning rate: Horovod's `LearningRateWarmupCallback` ramps the rate up to
`size` times the single-worker rate. `tfgpt.optim.schedules.WarmupDecay`
with `peak = base_rate * distribution.size`, as the inner optimizer's
`learning_rate`, does the same from step 0 and then decays; it is a function
of `optimizer.iterations`, which is identical on every rank, so no callback
is needed.

float16: `compile()` wraps any optimizer that is not a
`keras.optimizers.LossScaleOptimizer` in one when the model's policy is
`mixed_float16`. It would then wrap the `DistributedOptimizer` and skip
steps on *local* non-finite gradients, so ranks would skip different steps
and their collectives would no longer match. `BroadcastInitialState` rejects
that combination; use `mixed_bfloat16` (no loss scaling needed), or the
custom trainer, which checks finiteness on the averaged gradients.

Metrics: `AverageMetrics` averages the epoch logs (train and validation);
per-batch logs and the progress bar stay per rank. Average a standalone
`model.evaluate(..., return_dict=True)` with `average_logs`.

Steps: every step is a collective, so every rank must run as many: repeat
the dataset and pass `steps_per_epoch`, e.g.
`pipelines.reader.steps_per_epoch(data, "train", batch_size, num_workers=size)`.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from tfgpt.parallel import refusals


@functools.lru_cache(maxsize=None)
def _default_distribution():
    # One HorovodDistribution (one hvd.init()) per process, created on first
    # use, so that deserializing a DistributedOptimizer or constructing the
    # callbacks does not start Horovod in a process that never trains.
    from tfgpt.parallel.horovod_bridge import HorovodDistribution

    return HorovodDistribution()


def _inside_xla_cluster():
    """True while tracing inside a `tf.function(jit_compile=True)`."""
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # private modules; without them TF's own error shows
        return False
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


_XLA_MESSAGE = (
    "A Horovod allreduce cannot run inside an XLA cluster (this Horovod build "
    "has no XLA kernel for HorovodAllreduce), and `model.fit` with "
    "`jit_compile=True` compiles the whole train step, the optimizer's "
    "gradient averaging included, as one cluster. Compile the model with "
    "`model.compile(..., jit_compile=False)` (`jit_compile='auto'` turns XLA "
    "on when a GPU is visible), or use `train_hvd.py --xla`, which compiles "
    "only the forward and backward pass."
)


def dense_gradient(gradient):
    """Converts an `IndexedSlices` gradient (embedding lookups) to a tensor.

    Horovod fuses dense allreduces into one transfer; for the vocabularies
    here the dense form also costs less than Horovod's allgather of slices.
    """
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


@keras.saving.register_keras_serializable(package="tfgpt")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Averages gradients over all Horovod workers, then applies `optimizer`.

    A Keras 3 optimizer that wraps another one, as
    `keras.optimizers.LossScaleOptimizer` does: `apply` (and so
    `apply_gradients`, which `model.fit` calls) averages the gradients in
    one fused allreduce and hands the result to the inner optimizer. Every
    rank then applies the same update, so weights that start equal (see
    `BroadcastInitialState`) stay equal. The learning rate, the step
    counter, `scale_loss` and the slot variables are the inner optimizer's;
    configure it (weight decay exclusions, clipping) before wrapping.
    Clipping therefore sees the averaged gradients.

    It exists because `horovod.tensorflow.keras.DistributedOptimizer`
    silently does not average under Keras 3 (see the module docstring).
    The train step must not be XLA-compiled: `compile(jit_compile=False)`.

    Args:
        optimizer: keras.optimizers.Optimizer. The optimizer that updates
            the weights. (Under `mixed_float16`, `compile()` wraps this
            wrapper in a `LossScaleOptimizer`, which `BroadcastInitialState`
            refuses; see the module docstring.)
        distribution: optional `tfgpt.parallel` object with
            `allreduce_gradients` (default: the process's
            `HorovodDistribution`, created on first use). Pass
            `HorovodDistribution(compression="fp16")` to halve the traffic.
        name: optional str.

    Example (under `horovodrun -np 2`):
    >>> optimizer = DistributedOptimizer(keras.optimizers.AdamW(1e-3))  # doctest: +SKIP
    >>> model.compile(optimizer=optimizer, loss=loss, jit_compile=False)  # doctest: +SKIP
    """

    def __init__(self, optimizer, distribution=None, name=None, **kwargs):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`optimizer` must be a keras.optimizers.Optimizer. "
                f"Received: optimizer={optimizer!r}"
            )
        if distribution is not None:
            refusals.check(refusals.Run.of(distribution.state, command="fit"))
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError(
                "`optimizer` is already a DistributedOptimizer; wrapping it again "
                f"would average every gradient twice. Received: optimizer={optimizer!r}"
            )
        if kwargs:
            # The base class's arguments (clipnorm, weight_decay, ...) would
            # be silently unused here: they belong to the inner optimizer.
            raise ValueError(
                "DistributedOptimizer takes no optimizer arguments; set them on the "
                f"inner optimizer. Received: {sorted(kwargs)}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self._distribution = distribution

    def _get_distribution(self):
        # A method, not a property: Keras saving reads every public
        # attribute, which must not start Horovod in a process that only
        # saves or loads a model.
        if self._distribution is None:
            self._distribution = _default_distribution()
        return self._distribution

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "Call `optimizer.build(trainable_variables)` before applying "
                    "gradients without `trainable_variables`."
                )
            self.build(trainable_variables)
        if _inside_xla_cluster():
            raise ValueError(_XLA_MESSAGE)
        # A gradient that is None is None on every rank (same model, same
        # graph), so leaving it out keeps the ranks' allreduces matched.
        present = [index for index, gradient in enumerate(grads) if gradient is not None]
        averaged = self._get_distribution().allreduce_gradients(
            [dense_gradient(grads[index]) for index in present]
        )
        for index, gradient in zip(present, averaged):
            grads[index] = gradient
        self.inner_optimizer.apply(grads, trainable_variables)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        # Only the name: the distribution belongs to the process, not the model.
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)


def check_model(model):
    """Raises ValueError unless `model` is compiled so that fit averages correctly.

    Checks that the optimizer is a `DistributedOptimizer` (not wrapped in a
    `LossScaleOptimizer`) and that the train step is not XLA-compiled.
    `BroadcastInitialState` calls it before the first step.

    Args:
        model: keras.Model. A compiled model.
    """
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and isinstance(
        optimizer.inner_optimizer, DistributedOptimizer
    ):
        raise ValueError(
            "`model.compile()` wrapped the DistributedOptimizer in a "
            "LossScaleOptimizer (dtype policy mixed_float16): loss scaling would "
            "skip steps on each rank's own non-finite gradients, so the ranks' "
            "allreduces would no longer match. Use the mixed_bfloat16 policy, or "
            "train_hvd.py --mixed-precision float16. Received: "
            f"dtype_policy={model.dtype_policy.name!r}"
        )
    if not isinstance(optimizer, DistributedOptimizer):
        raise ValueError(
            "The model's optimizer must be a tfgpt.parallel.keras_horovod."
            "DistributedOptimizer, or the ranks' gradients are not averaged and "
            "their weights drift apart (horovod.tensorflow.keras.DistributedOptimizer "
            f"does not average under Keras 3). Received: optimizer={optimizer!r}"
        )
    if model.jit_compile:
        raise ValueError(f"{_XLA_MESSAGE} Received: model.jit_compile={model.jit_compile!r}")


class BroadcastInitialState(keras.callbacks.Callback):
    """Copies rank 0's weights and optimizer state to every rank before training.

    Ranks that build a model from different random seeds, or only rank 0
    restoring a checkpoint, start equal after this. Keras 3 creates the
    optimizer's slot variables in `optimizer.build()`, so the whole state is
    broadcast in `on_train_begin`, before the first step (Horovod's TF1-era
    callback had to wait until after the first batch for the slots to exist).
    It also runs `check_model`, so a misconfigured run fails before its first
    step rather than hanging or drifting. Put it first in `callbacks`.

    It exists because Horovod's `BroadcastGlobalVariablesCallback` calls
    `Variable.ref()`, which Keras 3 variables do not have.

    Args:
        distribution: optional `tfgpt.parallel` object with
            `broadcast_variables` (default: the process's
            `HorovodDistribution`). The root is rank 0.

    Example (under `horovodrun -np 2`):
    >>> model.fit(dataset, steps_per_epoch=100,
    ...           callbacks=[BroadcastInitialState(), AverageMetrics()])  # doctest: +SKIP
    """

    def __init__(self, distribution=None):
        super().__init__()
        self._distribution = distribution

    def on_train_begin(self, logs=None):
        check_model(self.model)
        optimizer = self.model.optimizer
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        distribution = self._distribution or _default_distribution()
        distribution.broadcast_variables(self.model.variables + optimizer.variables)


def average_logs(logs, distribution=None):
    """Returns `logs` with every numeric value averaged over all workers.

    All workers must call it together with the same keys. Non-numeric
    values are returned unchanged. Use it on the dict that
    `model.evaluate(..., return_dict=True)` returns.

    Args:
        logs: dict of str to number.
        distribution: optional `tfgpt.parallel` object with
            `allreduce_mean` (default: the process's `HorovodDistribution`).

    Returns:
        dict. A new dict with the averaged values as Python floats.
    """
    distribution = distribution or _default_distribution()
    logs = dict(logs or {})
    # Sorted, so that every rank packs the same value in the same slot.
    keys = sorted(
        key
        for key, value in logs.items()
        if isinstance(value, (int, float, np.number, np.ndarray, tf.Tensor))
        and not isinstance(value, bool)
        and np.size(value) == 1
    )
    if keys:
        # One collective for all metrics rather than one per metric.
        values = tf.constant([float(logs[key]) for key in keys], tf.float64)
        averaged = np.asarray(distribution.allreduce_mean(values))
        logs.update({key: float(value) for key, value in zip(keys, averaged)})
    return logs


class AverageMetrics(keras.callbacks.Callback):
    """Replaces each epoch's metrics by their mean over all ranks.

    Each rank's `loss`, `val_loss` and metrics describe only its own shard
    of the data. At the end of every epoch this callback averages them
    across ranks and writes the result into the epoch's logs in place, so
    the callbacks after it (TensorBoard, ModelCheckpoint's `monitor`,
    EarlyStopping, the progress bar, `History`) see the global values, the
    same on every rank. Keras appends `History` and the progress bar after
    the user's callbacks, so they see the average too. Per-batch logs stay
    local. Ranks must run the same number of steps (as Horovod needs
    anyway), so the mean of the ranks' means is the global mean.

    It exists because Horovod's `MetricAverageCallback` calls
    `keras.backend.constant`, which Keras 3 removed.

    Args:
        distribution: optional `tfgpt.parallel` object with
            `allreduce_mean` (default: the process's `HorovodDistribution`).

    Example (under `horovodrun -np 2`; before the callbacks that read logs):
    >>> callbacks = [BroadcastInitialState(), AverageMetrics(),
    ...              *rank_zero_only([keras.callbacks.TensorBoard("tb")])]  # doctest: +SKIP
    """

    def __init__(self, distribution=None):
        super().__init__()
        self._distribution = distribution

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        logs.update(average_logs(logs, self._distribution))


def rank_zero_only(callbacks, distribution=None):
    """Returns `callbacks` on rank 0 and an empty list on the other ranks.

    For callbacks that write files (TensorBoard, ModelCheckpoint, CSVLogger):
    every rank holds the same weights, so one writer is enough, and several
    writing the same path corrupt it. Place them after `AverageMetrics` so
    that what they write is the global value.

    Args:
        callbacks: list of keras.callbacks.Callback.
        distribution: optional `tfgpt.parallel` object with `is_chief`
            (default: the process's `HorovodDistribution`).

    Example:
    >>> rank_zero_only([keras.callbacks.CSVLogger("log.csv")])  # doctest: +SKIP
    [<keras.src.callbacks.csv_logger.CSVLogger object at ...>]  # on rank 0
    """
    callbacks = list(callbacks)
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise ValueError(
                "`callbacks` must be a list of keras.callbacks.Callback. "
                f"Received an element {callback!r}"
            )
    distribution = distribution or _default_distribution()
    return callbacks if distribution.is_chief else []
