"""Multi-head causal self-attention with an optional key/value cache."""

import math

import keras
import tensorflow as tf

from tfgpt.config.checks import require_divisible
from tfgpt.kernels.causal_attention_kernel import (
    causal_attention,
    causal_attention_available,
)
from tfgpt.kernels.causal_softmax_kernel import causal_softmax
from tfgpt.layers.configured_layer import normal_initializer
from tfgpt.layers.rotary_embedding import inverse_frequencies, rotate
from tfgpt.layers.segments import same_segment
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
    (`c_proj`). Position i attends to positions <= i only, and with
    `segment_ids` (packed examples, `tfgpt.layers.segments`) to those of
    its own example only. Softmax runs in float32 under mixed precision.
    Without a cache or padding mask, on CPU with the fused kernels (packed
    rows' segment ids too): in float32 (and without attention dropout in
    training) the whole core is `tfgpt.kernels.causal_attention`, one
    kernel each way; otherwise the softmax is
    `tfgpt.kernels.causal_softmax`, one fused pass each way.

    With a cache, the layer writes this call's keys and values at
    `cache_index` and attends over every cached position up to the query's
    own, so generating a token costs one position instead of the whole
    prefix.

    With fewer key-value heads than query heads (grouped-query attention,
    Ainslie et al. 2023) the queries have their own projection (`query`)
    and the keys and values theirs (`key_value`, laid out [2, KV, D]); the
    cache holds the KV heads only, and each serves `num_heads / KV` query
    heads. With `rotary`, queries and keys are turned by their positions
    (`tfgpt.layers.rotary_embedding`) before the scores.

    Args:
        hidden_dim, num_heads, dropout, head_dim, output_bias: those of
            `SelfAttentionBase`.
        num_key_value_heads: int or None. Key and value heads; None:
            `num_heads`.
        attention_bias: bool. Biases on the query, key and value projections.
        scale: bool. Scale the scores by 1/sqrt(head_dim).
        window: int. Attend to the query and the `window - 1` keys before
            it only (a sliding window); 0: to every key before it.
        rotary: dict or None. The rotary embedding: `dim` (features of each
            head turned), `interleaved`, and the frequencies' `theta`,
            `scaling`, `factor`, `low_frequency_factor`,
            `high_frequency_factor`, `original_max_length`
            (`tfgpt.layers.rotary_embedding.inverse_frequencies`).

    Example:
    >>> layer = CausalSelfAttention(hidden_dim=8, num_heads=2)
    >>> layer(tf.zeros((1, 3, 8))).shape
    TensorShape([1, 3, 8])
    >>> grouped = CausalSelfAttention(8, 4, num_key_value_heads=2, rotary={"dim": 2})
    >>> grouped(tf.zeros((1, 3, 8))).shape
    TensorShape([1, 3, 8])
    """

    def __init__(self, hidden_dim, num_heads, dropout=0.0, num_key_value_heads=None,
                 attention_bias=True, scale=True, window=0, rotary=None, **kwargs):
        super().__init__(hidden_dim, num_heads, dropout=dropout, **kwargs)
        self.num_key_value_heads = num_key_value_heads or num_heads
        require_divisible("num_heads", num_heads, "num_key_value_heads",
                          self.num_key_value_heads)
        self.attention_bias, self.scale, self.window, self.rotary = (
            attention_bias, scale, window, rotary)
        self._config_names += ("num_key_value_heads", "attention_bias", "scale", "window",
                               "rotary")
        self.local_key_value_heads = self._local(self.num_key_value_heads, "num_key_value_heads")
        self.frequencies = None
        if rotary is not None:
            self.frequencies = inverse_frequencies(**rotary_arguments(rotary))
        initializer = normal_initializer()
        if self.num_key_value_heads == num_heads:
            self.query_key_value = self._heads_dense(3, "query_key_value", initializer,
                                                     use_bias=attention_bias)
        else:
            self.query = self._heads_dense(1, "query", initializer, use_bias=attention_bias)
            self.key_value = self._heads_dense(2, "key_value", initializer,
                                               heads=self.num_key_value_heads,
                                               use_bias=attention_bias)
        self._add_output_layers(initializer)

    @property
    def grouped(self):
        """Whether fewer key-value heads than query heads serve the queries."""
        return self.num_key_value_heads != self.num_heads

    def build(self, input_shape):
        if self.grouped:
            self.query.build(input_shape)
            self.key_value.build(input_shape)
        else:
            self.query_key_value.build(input_shape)
        self.output_projection.build(input_shape[:-1] + (self.local_dim,))
        self.built = True

    def call(
        self,
        inputs,
        padding_mask=None,
        cache=None,
        cache_index=0,
        positions=None,
        segment_ids=None,
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
            positions: optional int tensor (B, T) or (1, T): each token's
                position for the rotary embedding (left-padded rows start
                later); default `cache_index`, `cache_index + 1`, ...
            segment_ids: optional int tensor (B, S), S as for
                `padding_mask`: each key position's example in a packed
                row; a query attends to its own example's keys only. (The
                positions of packed examples are the caller's:
                `tfgpt.layers.segments.segment_positions`.)
            training: bool. Enables dropout.

        Returns:
            The output (B, T, C), and with a cache also the updated cache in
            the form it was given.
        """
        heads_input = self._heads_input(inputs)
        batch_size = tf.shape(inputs)[0]
        length = tf.shape(inputs)[1]
        if self.grouped:
            query = self.query(heads_input)  # (B, T, H*D)
            query = tf.transpose(tf.reshape(
                query, [batch_size, length, self.local_heads, self.head_dim]),
                [0, 2, 1, 3])  # (B, H, T, D)
            key_value = tf.reshape(self.key_value(heads_input), [
                batch_size, length, 2, self.local_key_value_heads, self.head_dim])  # (B,T,2,KV,D)
            key_value = tf.transpose(key_value, [2, 0, 3, 1, 4])  # (2, B, KV, T, D)
            key, value = tf.unstack(key_value, 2)  # 2 x (B, KV, T, D)
        else:
            qkv = self.query_key_value(heads_input)  # (B, T, 3C)
            plain = self.rotary is None and self.scale and not self.window
            if plain and causal_attention_available(
                qkv.dtype, self.dropout if training else 0.0, padding_mask, cache
            ):
                # Float32 on CPU: one fused kernel each way reads the heads out
                # of the projection and skips the masked score blocks.
                attended = causal_attention(qkv, self.local_heads, segment_ids)  # (B, T, C)
                return self._project_output(attended)  # (B, T, C)
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
        if self.frequencies is not None:
            if positions is None:
                positions = (tf.range(length) + cache_index)[tf.newaxis]  # (1, T)
            interleaved = self.rotary.get("interleaved", False)
            query = rotate(query, positions, self.frequencies, interleaved)  # (B, H, T, D)
            key = rotate(key, positions, self.frequencies, interleaved)  # (B, KV, T, D)
        if self.scale:
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

        if self.grouped:
            # Each key-value head serves its group of query heads.
            groups = self.local_heads // self.local_key_value_heads
            key = tf.repeat(key, groups, axis=1)  # (B, H, S, D)
            value = tf.repeat(value, groups, axis=1)  # (B, H, S, D)
        scores = tf.matmul(query, key, transpose_b=True)  # (B, H, T, S)
        if (cache is None and padding_mask is None and not self.window
                and inputs.shape[1] is not None):
            # Training: masked softmax (causal, within packed examples) in one
            # fused pass each way on CPU (tfgpt.kernels), else cast, bias,
            # softmax, cast back.
            weights = causal_softmax(scores, segment_ids)  # (B, H, T, T), compute dtype
        else:
            scores = tf.cast(scores, "float32") + self._mask_bias(
                inputs, key, padding_mask, cache_index, segment_ids
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

    def _mask_bias(self, inputs, key, padding_mask, cache_index, segment_ids=None):
        """Additive float32 mask (1, 1, T, S) or (B, 1, T, S): 0 where a
        query may attend, `MASKED_SCORE` elsewhere.

        An add costs nothing in the backward pass, where a select costs a
        second select.
        """
        query_positions = tf.range(tf.shape(inputs)[1]) + cache_index  # (T,)
        key_positions = tf.range(tf.shape(key)[2])  # (S,)
        allowed = key_positions[tf.newaxis, :] <= query_positions[:, tf.newaxis]  # (T, S)
        if self.window:
            earliest = query_positions[:, tf.newaxis] - self.window  # (T, 1)
            allowed = tf.logical_and(allowed, key_positions[tf.newaxis, :] > earliest)  # window
        allowed = allowed[tf.newaxis, tf.newaxis]  # (1, 1, T, S)
        if padding_mask is not None:
            allowed = tf.logical_and(allowed, self._keys_real(padding_mask))  # (B, 1, T, S)
        if segment_ids is not None:  # block-diagonal: the query's own example
            same = same_segment(segment_ids, cache_index, tf.shape(inputs)[1])  # (B, T, S)
            allowed = tf.logical_and(allowed, same[:, tf.newaxis])  # (B, 1, T, S)
        return tf.where(allowed, 0.0, MASKED_SCORE)  # (B or 1, 1, T, S)


def rotary_arguments(rotary):
    """`inverse_frequencies`' keyword arguments from an attention's `rotary` dict."""
    return {
        "rotary_dim": rotary["dim"],
        "theta": rotary.get("theta", 10000.0),
        "scaling": rotary.get("scaling", "none"),
        "factor": rotary.get("factor", 1.0),
        "low_frequency_factor": rotary.get("low_frequency_factor", 1.0),
        "high_frequency_factor": rotary.get("high_frequency_factor", 4.0),
        "original_max_length": rotary.get("original_max_length", 8192),
    }
