"""Causally masked softmax through the fused `TfgptCausalSoftmax` kernel, or
TensorFlow's composite ops."""

import numpy as np
import tensorflow as tf

import tfgpt.kernels as kernels
from tfgpt.kernels import dispatch

# Added to the float32 scores of masked positions on the composite path: a
# large finite negative, whose exponential is exactly 0 next to any visible
# score, as the fused kernel writes.
MASK_VALUE = -1e9


def causal_bias(query_length, key_length):
    """Additive float32 mask (T, S): 0 where query i may see key j, i.e.
    j <= i + (S - T), and `MASK_VALUE` elsewhere.

    A constant when both lengths are Python ints (built once when a step is
    traced, instead of compared and selected at every call), else computed.
    """
    if isinstance(query_length, int) and isinstance(key_length, int):
        offset = key_length - query_length
        upper = np.triu(np.ones((query_length, key_length), dtype=bool), k=offset + 1)
        return tf.constant(np.where(upper, MASK_VALUE, 0.0).astype("float32"))  # (T, S)
    query_positions = tf.range(query_length) + (key_length - query_length)  # (T,)
    allowed = tf.range(key_length)[tf.newaxis, :] <= query_positions[:, tf.newaxis]  # (T, S)
    return tf.where(allowed, 0.0, MASK_VALUE)  # (T, S)


def causal_softmax(scores):
    """Softmax over the last axis of `scores` (..., T, S) with a causal mask.

    Query i (the last T of S positions) sees keys j <= i + (S - T): for
    T == S the usual lower triangle, for S > T a prefix of S - T keys every
    query sees. Masked probabilities are exactly 0.

    Args:
        scores: float tensor (..., T, S), S >= T (float32, bfloat16 or
            float16).

    Returns:
        The probabilities, in `scores`' dtype.

    The fused kernel works in float32 on each row's visible prefix only and
    rounds once to `scores`' dtype; its gradient is one pass as well. The
    composite path is what attention layers run without it: cast to
    float32, add `causal_bias`, `tf.nn.softmax`, cast back.

    Example:
    >>> causal_softmax(tf.zeros([2, 2])).numpy()
    array([[1. , 0. ],
           [0.5, 0.5]], dtype=float32)
    """
    scores = tf.convert_to_tensor(scores)
    if scores.shape.rank is not None and scores.shape.rank < 2:
        raise ValueError(
            "`scores` must have rank >= 2 (..., T, S). "
            f"Received: scores.shape={tuple(scores.shape)}"
        )
    query_length, key_length = scores.shape[-2], scores.shape[-1]
    if query_length is not None and key_length is not None and key_length < query_length:
        # The first T - S queries would see no key at all.
        raise ValueError(
            "`scores` (..., T, S) must have S >= T. "
            f"Received: scores.shape={tuple(scores.shape)}"
        )
    if dispatch.runs("softmax", scores.dtype):
        return kernels.library().tfgpt_causal_softmax(scores)
    if query_length is None or key_length is None:
        dynamic = tf.shape(scores)
        query_length, key_length = dynamic[-2], dynamic[-1]
    probabilities = tf.nn.softmax(
        tf.cast(scores, "float32") + causal_bias(query_length, key_length), axis=-1
    )  # (..., T, S)
    return tf.cast(probabilities, scores.dtype)


@tf.RegisterGradient("TfgptCausalSoftmax")
def _causal_softmax_gradient(op, gradient):
    return kernels.library().tfgpt_causal_softmax_grad(gradient, op.outputs[0])
