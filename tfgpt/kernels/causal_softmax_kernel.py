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


def causal_softmax(scores, segment_ids=None):
    """Softmax over the last axis of `scores` (..., T, S) with a causal mask.

    Query i (the last T of S positions) sees keys j <= i + (S - T): for
    T == S the usual lower triangle, for S > T a prefix of S - T keys every
    query sees. With `segment_ids`, only the keys of the query's own
    example among those (a block-diagonal causal mask). Masked
    probabilities are exactly 0.

    Args:
        scores: float tensor (..., T, S), S >= T (float32, bfloat16 or
            float16); (B, ..., T, S) with `segment_ids`.
        segment_ids: optional int tensor (B, S): each key position's
            example in a packed row (`tfgpt.layers.segments`); query i's is
            that of position i + (S - T).

    Returns:
        The probabilities, in `scores`' dtype.

    The fused kernel works in float32 on each row's visible keys only and
    rounds once to `scores`' dtype; its gradient is one pass as well. The
    composite path is what attention layers run without it: cast to
    float32, add `causal_bias` (and `MASK_VALUE` where the segments
    differ), `tf.nn.softmax`, cast back.

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
    rank = scores.shape.rank
    if segment_ids is not None and (rank is None or rank < 3):
        raise ValueError(
            "With `segment_ids`, `scores` must have a known rank >= 3 (B, ..., T, S). "
            f"Received: scores.shape={scores.shape}"
        )
    if dispatch.runs("softmax", scores.dtype):
        # The op's optional input: a list of no tensor or one.
        segments = [] if segment_ids is None else [tf.cast(segment_ids, "int32")]
        return kernels.library().tfgpt_causal_softmax(scores, segments)
    if query_length is None or key_length is None:
        dynamic = tf.shape(scores)
        query_length, key_length = dynamic[-2], dynamic[-1]
    bias = causal_bias(query_length, key_length)  # (T, S)
    if segment_ids is not None:
        segment_ids = tf.cast(segment_ids, "int32")  # (B, S)
        queries = segment_ids[:, key_length - query_length:]  # (B, T)
        same = tf.equal(queries[:, :, tf.newaxis], segment_ids[:, tf.newaxis, :])  # (B, T, S)
        same = tf.reshape(same, tf.concat(
            [tf.shape(same)[:1], tf.ones([rank - 3], "int32"), tf.shape(same)[1:]], 0)
        )  # (B, 1, ..., T, S)
        bias = tf.where(same, bias, MASK_VALUE)  # (B, 1, ..., T, S)
    probabilities = tf.nn.softmax(tf.cast(scores, "float32") + bias, axis=-1)  # (..., T, S)
    return tf.cast(probabilities, scores.dtype)


@tf.RegisterGradient("TfgptCausalSoftmax")
def _causal_softmax_gradient(op, gradient):
    segments = list(op.inputs[1:])  # [] or [segment_ids (B, S)]
    dscores = kernels.library().tfgpt_causal_softmax_grad(gradient, op.outputs[0], segments)
    return [dscores] + [None] * len(segments)
