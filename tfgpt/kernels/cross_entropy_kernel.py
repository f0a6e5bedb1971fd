"""Sparse softmax cross-entropy through the fused `TfgptSparseCrossEntropy`
kernel, or TensorFlow's own op."""

import tensorflow as tf

import tfgpt.kernels as kernels
from tfgpt.kernels import dispatch


def _uncast(logits):
    """The bfloat16/float16 tensor a float32 `logits` was cast from, if any.

    Models return float32 logits (a cast after the vocabulary projection
    under mixed precision). In a traced graph the kernel can read the
    low-precision tensor instead, which skips that cast's (N, V) pass and
    halves what the loss reads; the unused cast is then pruned.
    """
    op = getattr(logits, "op", None)
    if (
        op is not None
        and not tf.executing_eagerly()
        and op.type == "Cast"
        and op.inputs[0].dtype in (tf.bfloat16, tf.float16)
    ):
        return op.inputs[0]
    return logits


def sparse_cross_entropy(labels, logits):
    """Per-position `-log softmax(logits)[label]` in float32.

    Args:
        labels: int tensor (...,), values in [0, V).
        logits: float tensor (..., V): float32, or bfloat16/float16.

    Returns:
        float32 tensor (...,). Out-of-range labels raise
        `InvalidArgumentError`, as TensorFlow's op does on CPU.

    The fused kernel reads each row once in its own dtype, computes in
    float32 and keeps the gradient (softmax - one_hot) in that dtype; the
    composite path is `tf.nn.sparse_softmax_cross_entropy_with_logits` on
    float32 logits.
    """
    logits = tf.convert_to_tensor(logits)
    if not dispatch.runs("cross_entropy", logits.dtype):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.cast(logits, "float32")
        )
    logits = _uncast(logits)
    shape = tf.shape(labels)
    losses, _ = kernels.library().tfgpt_sparse_cross_entropy(
        tf.reshape(logits, [-1, tf.shape(logits)[-1]]), tf.reshape(labels, [-1])
    )
    return tf.reshape(losses, shape)


@tf.RegisterGradient("TfgptSparseCrossEntropy")
def _sparse_cross_entropy_gradient(op, loss_gradient, _):
    # d loss_i / d logits_i = backprop_i (computed by the forward pass).
    backprop = op.outputs[1]
    return tf.expand_dims(tf.cast(loss_gradient, backprop.dtype), -1) * backprop, None
