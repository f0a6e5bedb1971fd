"""Multi-head causal self-attention with an optional key/value cache."""

import math

import keras
import tensorflow as tf

from tfgpt.kernels.causal_attention_kernel import (
    causal_attention,
    causal_attention_available,
)
from tfgpt.kernels.causal_softmax_kernel import causal_softmax
from tfgpt.layers.configured_layer import normal_initializer
from tfgpt.layers.self_attention_base import MASKED_SCORE, SelfAttentionBase

try:  # Private, long-stable TF API; without it every write takes the XLA op.
    from tensorflow.python.framework.ops import get_default_graph
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext
except ImportError:  # pragma: no cover
    GraphOrParentsInXlaContext = None


def write_slice(tensor, start, update):
    """Returns `tensor` with `update` written at index `start` (ints or scalars).

    Under XLA this is `dynamic_update_slice`, done in place in a compiled
    decoding loop. Elsewhere `keras.ops.slice_update` would run the same XLA
    op compiled on demand, which copies the whole tensor on every call
    (~200 us for a gpt-mini layer's 1 k-position cache, measured);
    TensorStridedSliceUpdate writes in place when TensorFlow can hand it the
    buffer (~25 us), which makes a graph-mode decoding step ~2 ms faster.
    """
    if GraphOrParentsInXlaContext is None or GraphOrParentsInXlaContext(get_default_graph()):
        return keras.ops.slice_update(tensor, start, update)
    begin = tf.stack([tf.cast(index, tf.int32) for index in start])
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=tensor,
        begin=begin,
        end=begin + tf.shape(update),
        strides=tf.ones_like(begin),
        value=update,
    )


@keras.saving.register_keras_serializable(package="tfgpt")
class CausalSelfAttention(SelfAttentionBase):
    """Causal multi-head self-attention (Vaswani et al. 2017, GPT-2 layout).

    One dense layer projects the input to queries, keys and values for all
    heads at once (GPT-2's `c_attn`), each head of width
    `hidden_dim // num_heads`; a second projects the concatenated heads back
    (`c_proj`). Position i attends to positions <= i only. Softmax runs in
    float32 under mixed precision. Without a cache or padding mask, on CPU
    with the fused kernels: in float32 (and without attention dropout in
    training) the whole core is `tfgpt.kernels.causal_attention`, one
    kernel each way; otherwise the softmax is
    `tfgpt.kernels.causal_softmax`, one fused pass each way.

    With a cache, the layer writes this call's keys and values at
    `cache_index` and attends over every cached position up to the query's
    own, so generating a token costs one position instead of the whole
    prefix.

    Args:
        hidden_dim, num_heads, dropout: those of `SelfAttentionBase`.

    Example:
    >>> layer = CausalSelfAttention(hidden_dim=8, num_heads=2)
    >>> layer(tf.zeros((1, 3, 8))).shape
    TensorShape([1, 3, 8])
    """

    def __init__(self, hidden_dim, num_heads, dropout=0.0, **kwargs):
        super().__init__(hidden_dim, num_heads, dropout=dropout, **kwargs)
        initializer = normal_initializer()
        self.query_key_value = self._heads_dense(3, "query_key_value", initializer)
        self._add_output_layers(initializer)

    def build(self, input_shape):
        self.query_key_value.build(input_shape)
        self.output_projection.build(input_shape[:-1] + (self.local_dim,))
        self.built = True

    def call(
        self,
        inputs,
        padding_mask=None,
        cache=None,
        cache_index=0,
        training=None,
    ):
        """Attends causally over `inputs` (B, T, C).

        Args:
            inputs: float tensor (B, T, C).
            padding_mask: optional bool/int tensor (B, S) marking real key
                positions (S = T without a cache, the cache length with one).
            cache: optional cached keys and values: one tensor
                (B, 2, H, S, D), or a pair `(key, value)` of (B, H, S, D)
                tensors, which a decoding loop updates without slicing (XLA
                then writes each in place).
            cache_index: int or scalar int tensor. Position of `inputs[:, 0]`
                in the cache.
            training: bool. Enables dropout.

        Returns:
            The output (B, T, C), and with a cache also the updated cache in
            the form it was given.
        """
        qkv = self.query_key_value(self._heads_input(inputs))  # (B, T, 3C)
        if causal_attention_available(
            qkv.dtype, self.dropout if training else 0.0, padding_mask, cache
        ):
            # Float32 on CPU: one fused kernel each way reads the heads out
            # of the projection and skips the masked score blocks.
            attended = causal_attention(qkv, self.local_heads)  # (B, T, C)
            return self._project_output(attended)  # (B, T, C)
        batch_size = tf.shape(inputs)[0]
        length = tf.shape(inputs)[1]
        qkv = tf.reshape(
            qkv, [batch_size, length, 3, self.local_heads, self.head_dim]
        )  # (B, T, 3, H, D)
        # One transpose puts (q, k, v) first and heads before time; unstacking
        # the leading axis then gives three contiguous (B, H, T, D) tensors,
        # and its gradient is one concatenation. (Slicing a middle axis gave
        # each slice a full-size StridedSliceGrad in the backward pass: 17%
        # of a graph-mode gpt-mini step in the profile.)
        qkv = tf.transpose(qkv, [2, 0, 3, 1, 4])  # (3, B, H, T, D)
        query, key, value = tf.unstack(qkv, 3)  # 3 x (B, H, T, D)
        # The 1/sqrt(D) scale on the query (T x D) rather than on the scores (T x S).
        query = query * tf.cast(1.0 / math.sqrt(self.head_dim), query.dtype)

        # Caches are head-major, as the matmuls below read them, so a decoding
        # step never transposes a whole cache.
        if isinstance(cache, (tuple, list)):
            start = [0, 0, cache_index, 0]
            key = write_slice(cache[0], start, key)  # (B, H, S, D)
            value = write_slice(cache[1], start, value)  # (B, H, S, D)
            cache = (key, value)
        elif cache is not None:
            start = [0, 0, 0, cache_index, 0]
            cache = write_slice(cache, start, tf.stack([key, value], axis=1))  # (B, 2, H, S, D)
            key, value = tf.unstack(cache, 2, axis=1)  # 2 x (B, H, S, D)

        scores = tf.matmul(query, key, transpose_b=True)  # (B, H, T, S)
        if cache is None and padding_mask is None and inputs.shape[1] is not None:
            # Training: masked softmax in one fused pass each way on CPU
            # (tfgpt.kernels), else cast, constant bias, softmax, cast back.
            weights = causal_softmax(scores)  # (B, H, T, T), compute dtype
        else:
            scores = tf.cast(scores, "float32") + self._mask_bias(
                inputs, key, padding_mask, cache_index
            )  # (B, H, T, S)
            weights = tf.nn.softmax(scores, axis=-1)  # (B, H, T, S)
        # Dropout gets the probabilities in the compute dtype from the fused
        # path. Nothing changes: Keras casts a layer's float32 input to its
        # compute dtype, so under mixed precision dropout already acted on
        # the rounded probabilities (same random draws, shape and dtype).
        outputs = self._attend(weights, value, batch_size, length, training)  # (B, T, C)
        if cache is not None:
            return outputs, cache
        return outputs

    def _mask_bias(self, inputs, key, padding_mask, cache_index):
        """Additive float32 mask (1, 1, T, S) or (B, 1, T, S): 0 where a
        query may attend, `MASKED_SCORE` elsewhere.

        An add costs nothing in the backward pass, where a select costs a
        second select.
        """
        query_positions = tf.range(tf.shape(inputs)[1]) + cache_index  # (T,)
        key_positions = tf.range(tf.shape(key)[2])  # (S,)
        allowed = key_positions[tf.newaxis, :] <= query_positions[:, tf.newaxis]  # (T, S)
        allowed = allowed[tf.newaxis, tf.newaxis]  # (1, 1, T, S)
        if padding_mask is not None:
            allowed = tf.logical_and(allowed, self._keys_real(padding_mask))  # (B, 1, T, S)
        return tf.where(allowed, 0.0, MASKED_SCORE)  # (B or 1, 1, T, S)
