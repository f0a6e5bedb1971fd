"""Packed sequences: several examples in one row, told apart by their segment ids.

A packed row (`pipelines.prepare --format instructions --pack`) holds
examples back to back; `segment_ids` (B, S) numbers each token's example
(1, 2, ... in the row; 0 for the padding after the last). A token attends
to the earlier tokens of its own example only (a block-diagonal causal
mask) and its position counts from its example's first token, so each
example is computed exactly as it would be alone in a row.

Example:
>>> segment_positions(tf.constant([[1, 1, 1, 2, 2, 0]])).numpy().tolist()
[[0, 1, 2, 0, 1, 0]]
"""

import tensorflow as tf


def same_segment(segment_ids, cache_index=0, length=None):
    """(B, T, S) bool: query t's segment is key s's.

    Args:
        segment_ids: int tensor (B, S): every key position's segment (S = T
            without a cache, the cache length with one).
        cache_index: int or scalar int tensor. The first query's position.
        length: int or scalar int tensor, or None. T, the queries; None: S.
    """
    segment_ids = tf.cast(segment_ids, "int32")
    if length is None:
        length = tf.shape(segment_ids)[1]
    queries = segment_ids[:, cache_index:cache_index + length]  # (B, T)
    return tf.equal(queries[:, :, tf.newaxis], segment_ids[:, tf.newaxis, :])  # (B, T, S)


def segment_positions(segment_ids, cache_index=0, length=None):
    """(B, T) int32: each query's position in its own example, the number of
    earlier keys of its segment. Arguments as for `same_segment`."""
    same = same_segment(segment_ids, cache_index, length)  # (B, T, S)
    queries = tf.range(tf.shape(same)[1]) + cache_index  # (T,)
    earlier = tf.range(tf.shape(same)[2])[tf.newaxis, :] < queries[:, tf.newaxis]  # (T, S)
    return tf.reduce_sum(tf.cast(tf.logical_and(same, earlier), "int32"), axis=-1)  # (B, T)
