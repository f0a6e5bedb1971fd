"""The compiled training and evaluation steps shared by every front end."""

import time

import keras
import tensorflow as tf

from tfgpt.config.checks import require_positive_int
from tfgpt.graph_function import graph_function
from tfgpt.parallel.local import LocalDistribution
from tfgpt.parallel.strategy import StrategyDistribution
from tfgpt.parallel.tensor_parallel import WHOLE
from tfgpt.parallel.zero import Unsharded


def cross_entropy(targets, logits, weights=None, tensor_slice=WHOLE):
    """Mean token cross-entropy in float32, optionally weighted (B, T) or (B, P).

    With a `tensor_slice` (`tfgpt.parallel.tensor_parallel`), `logits`
    are the slice's part of the vocabulary, combined over its tensor group.
    """
    losses = tensor_slice.cross_entropy(targets, logits)
    if weights is None:
        return tf.reduce_mean(losses)
    weights = tf.cast(weights, "float32")
    return tf.reduce_sum(losses * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)


def causal_lm_loss(model, batch, training):
    """Next-token loss of a decoder on an `(inputs, targets)` batch."""
    inputs, targets = batch
    logits = model(inputs, training=training)
    return cross_entropy(targets, logits, tensor_slice=getattr(model, "tensor_slice", WHOLE)), {}


def _dense(gradient):
    # Embedding lookups give IndexedSlices; a dense tensor is averaged by an
    # allreduce that Horovod fuses with the others, and for vocabularies of
    # this size the dense form is cheaper than Horovod's allgather of slices.
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


def _compiled_parts(distribution, xla, sharding):
    """What XLA compiles for `distribution` (see TrainStep)."""

    if not xla:
        return ()
    # ZeRO's update runs collectives (its stage 3 with --xla: tfgpt.parallel.refusals).
    if sharding.runs_collectives or isinstance(distribution, StrategyDistribution):
        return ("compute",)
    if type(distribution) is LocalDistribution:
        return ("step",)
    return ("compute", "update")


# The step's result holds, besides its metrics, this float64 pair of seconds
# (see TrainStep): the forward and backward pass, then the wait for the
# averaged gradients after it.
STEP_TIMES = "step_times"


def _timestamp_after(tensors):
    with tf.control_dependencies(tensors):
        return tf.timestamp()


def _loss_scale(optimizer):
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale
    return None


class TrainStep:
    """Forward, backward, gradient averaging and the optimizer update.

    What XLA compiles (`compiled`) depends on `xla` and on where the
    gradients are averaged, since a collective cannot run inside an XLA
    cluster here:

    - `xla=False`: nothing; the step runs in graph mode on TensorFlow's
      oneDNN kernels (on CPU, XLA's own bfloat16 matmuls are several times
      slower). Compiling only the optimizer update was tried: no faster on
      an idle machine, and 0.7 GiB more peak memory for GPT-2 small;
    - `xla=True`, one process (`LocalDistribution`, nothing to average):
      the whole step, forward, backward, clipping and update, is one XLA
      cluster (`("step",)`);
    - `xla=True`, Horovod (or any other distribution whose
      `allreduce_gradients` is not a `tf.distribute` replica all-reduce):
      the forward/backward pass and the update are compiled apart, with
      the allreduce between them (`("compute", "update")`);
    - a `tf.distribute` strategy, or ZeRO stage 1 or 2 (`zero`): the
      forward/backward pass with `xla`, nothing without (ZeRO's update
      runs collectives; stage 3 gathers weights inside the forward pass
      and refuses `xla`). Keras applies the update through `merge_call`,
      which cannot run inside a nested (XLA-compiled) `tf.function`
      ("`merge_call` called while defining a new graph").

    With `accumulation_steps=K`, every leaf of a batch carries a leading
    axis of K micro-batches; their gradients are averaged locally before
    they are averaged across workers and applied once, so the update equals
    that of one batch K times larger.

    With `towers=K`, each (micro-)batch is cut along its first axis into K
    equal slices whose losses are averaged: K independent forward and
    backward chains in one graph, which TensorFlow's inter-op pool runs at
    the same time, each op on its share of the threads
    (`tfgpt.parallel.cpu_threads`). The gradients are those of the mean
    of the slices' losses, the same as for the whole batch when the loss is
    a plain mean over equal slices (the causal LM loss); a loss weighted by
    a mask is averaged per slice first, as across workers.

    Args:
        model: keras.Model.
        optimizer: keras optimizer (LossScaleOptimizer under float16).
        distribution: a `tfgpt.parallel` object: its `run` places the
            step on the replicas and `allreduce_gradients` averages.
        loss_fn: callable `(model, batch, training) -> (loss, metrics)`;
            defaults to the causal language-model loss.
        xla: bool. JIT-compile the forward and backward pass.
        accumulation_steps: int. Micro-batches per update.
        towers: int. Slices of each batch computed side by side; the
            batch's first axis must be divisible by it.
        zero: a `tfgpt.parallel.zero.ZeroSharding` (Horovod with
            `--zero-stage` 1-3), which then reduces the gradients and
            applies the update on this rank's shards; None averages whole
            gradients through `distribution`.
        token_weights: callable `batch -> weights` (any shape) of a loss
            that is a weighted mean over tokens (`cross_entropy` with
            `weights`), or None. Given, the step's loss is that of the
            global batch: the sum of its weighted token losses over its
            weight total, counted over every replica, micro-batch and tower,
            not a mean of their means (which would favour whoever has
            fewer learned tokens). Each part's loss is scaled by its share
            of the weight total times the number of parts, so that the
            average over the parts, which the step takes, is the global one.
        compute_delay: float. Seconds each forward pass starts late, inside
            the measured compute (test-only fault injection:
            `tfgpt.resilience.faults`).

    A model built in a tensor slice (`model.tensor_slice`,
    `tfgpt.parallel.tensor_parallel`) has its gradient norm summed over
    its tensor group (the slices' squares once each, the replicated
    parameters' once).

    Calling it with a batch returns a dict of scalars: `loss` (this
    worker's mean), `gradient_norm` (global norm of the averaged, unscaled
    gradients before clipping), and whatever `loss_fn` reports; and, unless
    XLA compiles the whole step, `STEP_TIMES`: float64 seconds of the
    forward and backward pass (from the step's start to its last local
    gradient) and of the wait for the averaged gradients after it (the
    communication the backward pass did not hide; under ZeRO stages 2 and
    3 the reduce-scatters run inside the backward pass and count there).
    Both come from `tf.timestamp` ops ordered by data dependencies.
    """

    def __init__(
        self, model, optimizer, distribution, loss_fn=causal_lm_loss, xla=False,
        accumulation_steps=1, towers=1, zero=None, compute_delay=0.0, token_weights=None,
    ):
        require_positive_int("accumulation_steps", accumulation_steps)
        require_positive_int("towers", towers)
        self.model = model
        self.optimizer = optimizer
        self.distribution = distribution
        self.loss_fn = loss_fn
        self.accumulation_steps = accumulation_steps
        self.towers = towers
        self.token_weights = token_weights
        self.variables = model.trainable_variables
        self.sharding = zero or Unsharded(model, optimizer, distribution)
        self.compute_delay = compute_delay
        self.compiled = _compiled_parts(distribution, xla, self.sharding)
        self._forward_backward = self._forward_backward_fn
        self._update = self._update_fn
        if "compute" in self.compiled:
            self._forward_backward = graph_function(self._forward_backward_fn, jit_compile=True)
        if "update" in self.compiled:
            self._update = graph_function(self._update_fn, jit_compile=True)
        if self.compiled == ("step",):
            self._step = graph_function(self._replica_step, jit_compile=True)
        else:
            self._step = graph_function(lambda batch: distribution.run(self._replica_step, batch))

    def _scaled(self, loss, batch, factor):
        """A weighted mean `loss` of `batch` as its share of the global one (`token_weights`)."""
        if factor is None:
            return loss
        return loss * tf.reduce_sum(tf.cast(self.token_weights(batch), loss.dtype)) * factor

    def _towers_loss(self, batch, factor=None):
        if self.towers == 1:
            loss, metrics = self.loss_fn(self.model, batch, True)
            return self._scaled(loss, batch, factor), metrics
        # Each leaf (B, ...) -> K slices (B / K, ...); nothing joins the
        # slices' chains before the variables' gradients are summed.
        slices = [tf.split(leaf, self.towers) for leaf in tf.nest.flatten(batch)]
        towers = [tf.nest.pack_sequence_as(batch, [parts[index] for parts in slices])
                  for index in range(self.towers)]
        results = [self.loss_fn(self.model, tower, True) for tower in towers]
        scale = 1.0 / self.towers
        loss = tf.add_n([self._scaled(loss, tower, None if factor is None else factor * self.towers)
                         for (loss, _), tower in zip(results, towers)]) * scale
        metrics = tf.nest.map_structure(
            lambda *values: tf.add_n(list(values)) * scale, *[m for _, m in results]
        )
        return loss, metrics

    def _forward_backward_fn(self, batch, factor=None):
        # Sources are the tf.Variables inside the Keras 3 variables (under
        # ZeRO stage 3, those of this rank's shards).
        sources = self.sharding.gradient_sources()
        with tf.GradientTape() as tape:
            with self.sharding.loss_scope():
                loss, metrics = self._towers_loss(batch, factor)
            scaled_loss = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled_loss, sources)
        gradients = [
            tf.zeros_like(source) if g is None else _dense(g)
            for g, source in zip(gradients, sources)
        ]
        return loss, metrics, gradients

    def _micro_batch(self, batch, factor=None):
        loss, metrics, gradients = self._forward_backward(batch, factor)
        return loss, metrics, self.sharding.reduce_micro_batch(gradients)

    def _accumulate(self, batch, factor=None):
        count = self.accumulation_steps
        if count == 1:
            return self._micro_batch(batch, factor)
        micro = lambda index: tf.nest.map_structure(lambda t: t[index], batch)  # noqa: E731
        loss, metrics, gradients = self._micro_batch(micro(0), factor)

        def add_micro_batch(index, loss, metrics, gradients):
            next_loss, next_metrics, next_gradients = self._micro_batch(micro(index), factor)
            return (
                index + 1,
                loss + next_loss,
                tf.nest.map_structure(tf.add, metrics, next_metrics),
                [a + b for a, b in zip(gradients, next_gradients)],
            )

        _, loss, metrics, gradients = tf.while_loop(
            lambda index, *_: index < count,
            add_micro_batch,
            (tf.constant(1), loss, metrics, gradients),
            parallel_iterations=self.sharding.loop_parallelism,
        )
        scale = 1.0 / count
        return (
            loss * scale,
            tf.nest.map_structure(lambda m: m * scale, metrics),
            [g * scale for g in gradients],
        )

    def _update_fn(self, gradients):
        return self.sharding.apply(gradients, _loss_scale(self.optimizer))

    def _replica_step(self, batch):
        timed = self.compiled != ("step",)  # XLA has no timestamp op
        start = None
        if timed:
            # The batch waits for the first timestamp: nothing else orders a
            # source op before the forward pass.
            start = tf.timestamp()
            after = [start]
            delay = self.compute_delay
            if delay:
                with tf.control_dependencies([start]):
                    after.append(tf.py_function(lambda: time.sleep(delay) or 0.0, [], tf.float32))
            with tf.control_dependencies(after):
                batch = tf.nest.map_structure(tf.identity, batch)
        factor = None
        if self.token_weights is not None:  # parts: replicas x micro-batches
            total = self.distribution.replica_sum(
                tf.reduce_sum(tf.cast(self.token_weights(batch), tf.float32)))
            factor = self.distribution.size * self.accumulation_steps / tf.maximum(total, 1.0)
        loss, metrics, gradients = self._accumulate(batch, factor)
        computed = _timestamp_after(gradients) if timed else None
        # Averaged whole, or (ZeRO) reduced to this rank's shards, then applied.
        gradients = self.sharding.reduce_accumulated(gradients)
        reduced = _timestamp_after(gradients) if timed else None
        gradient_norm = self._update(gradients)
        result = {"loss": loss, "gradient_norm": gradient_norm, **metrics}
        if timed:
            result[STEP_TIMES] = tf.stack([computed - start, reduced - computed])
        return result

    def __call__(self, *batch):
        # step(batch) or step(inputs, targets).
        return self._step(batch[0] if len(batch) == 1 else batch)


class EvalStep:
    """Returns `(loss, metrics)` of a batch without training, compiled once.

    `zero`: the run's `ZeroSharding`, whose stage 3 gathers the weights.
    """

    def __init__(self, model, loss_fn=causal_lm_loss, xla=False, zero=None):
        self.model = model
        self.loss_fn = loss_fn
        self.sharding = zero or Unsharded(model)
        self._step = graph_function(self._step_fn,
                                    jit_compile=xla and not self.sharding.runs_collectives)

    def _step_fn(self, batch):
        with self.sharding.loss_scope():
            return self.loss_fn(self.model, batch, False)

    def __call__(self, *batch):
        return self._step(batch[0] if len(batch) == 1 else batch)
