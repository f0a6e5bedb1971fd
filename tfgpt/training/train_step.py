"""The compiled training and evaluation steps shared by every front end."""

import tensorflow as tf


def cross_entropy(targets, logits):
    """Mean next-token cross-entropy in float32 (logits are float32 already)."""
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.cast(targets, "int32"), logits=tf.cast(logits, "float32")
    )  # (B, T)
    return tf.reduce_mean(losses)


def _dense(gradient):
    # Embedding lookups give IndexedSlices; a dense tensor allreduces in one
    # fused call, and for a vocabulary this size the dense form is cheaper
    # than Horovod's allgather of slices.
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


class TrainStep:
    """Forward, backward, gradient averaging and the optimizer update.

    The forward/backward pass is one `tf.function` (XLA-compiled when `xla`
    is set); averaging and the update run in a second one around it, so the
    collective stays outside the XLA cluster.

    Args:
        model: keras.Model returning float32 logits.
        optimizer: keras optimizer (LossScaleOptimizer under float16).
        distribution: object with `allreduce_gradients`.
        xla: bool. JIT-compile the forward and backward pass.

    Calling it with `(inputs, targets)` returns `(loss, gradient_norm)`, the
    loss of this worker's batch and the global norm of the averaged
    gradients before clipping.
    """

    def __init__(self, model, optimizer, distribution, xla=False):
        self.model = model
        self.optimizer = optimizer
        self.distribution = distribution
        self.variables = model.trainable_variables
        self._forward_backward = tf.function(self._forward_backward_fn, jit_compile=xla)
        self._step = tf.function(self._step_fn)

    def _forward_backward_fn(self, inputs, targets):
        with tf.GradientTape() as tape:
            logits = self.model(inputs, training=True)  # (B, T, V)
            loss = cross_entropy(targets, logits)
            scaled_loss = self.optimizer.scale_loss(loss)
        # Sources are the tf.Variables inside the Keras 3 variables.
        gradients = tape.gradient(scaled_loss, [v.value for v in self.variables])
        return loss, [_dense(g) for g in gradients]

    def _step_fn(self, inputs, targets):
        loss, gradients = self._forward_backward(inputs, targets)
        gradients = self.distribution.allreduce_gradients(gradients)
        gradient_norm = tf.linalg.global_norm(gradients)
        self.optimizer.apply(gradients, self.variables)
        return loss, gradient_norm

    def __call__(self, inputs, targets):
        return self._step(inputs, targets)


class EvalStep:
    """Returns the mean loss of a batch, compiled once."""

    def __init__(self, model, xla=False):
        self.model = model
        self._step = tf.function(self._step_fn, jit_compile=xla)

    def _step_fn(self, inputs, targets):
        return cross_entropy(targets, self.model(inputs, training=False))

    def __call__(self, inputs, targets):
        return self._step(inputs, targets)
