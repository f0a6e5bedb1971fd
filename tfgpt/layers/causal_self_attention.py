"""Multi-head causal self-attention with an optional key/value cache."""

import math

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfgpt")
class CausalSelfAttention(keras.layers.Layer):
    """Causal multi-head self-attention (Vaswani et al. 2017, GPT-2 layout).

    One dense layer projects the input to queries, keys and values for all
    heads at once (GPT-2's `c_attn`), each head of width
    `hidden_dim // num_heads`; a second projects the concatenated heads back
    (`c_proj`). Position i attends to positions <= i only. Softmax runs in
    float32 under mixed precision.

    With a cache, the layer writes this call's keys and values at
    `cache_index` and attends over every cached position up to the query's
    own, so generating a token costs one position instead of the whole
    prefix.

    Args:
        hidden_dim: int. Input and output width; must be divisible by
            `num_heads`.
        num_heads: int. Number of attention heads.
        dropout: float. Dropout rate on the attention probabilities.

    Example:
    >>> layer = CausalSelfAttention(hidden_dim=8, num_heads=2)
    >>> layer(tf.zeros((1, 3, 8))).shape
    TensorShape([1, 3, 8])
    """

    def __init__(self, hidden_dim, num_heads, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        if hidden_dim % num_heads:
            raise ValueError(
                "`hidden_dim` must be divisible by `num_heads`. "
                f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
            )
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.head_dim = hidden_dim // num_heads
        self.dropout = dropout
        initializer = keras.initializers.RandomNormal(stddev=0.02)
        self.query_key_value = keras.layers.Dense(
            3 * hidden_dim,
            kernel_initializer=initializer,
            dtype=self.dtype_policy,
            name="query_key_value",
        )
        self.output_projection = keras.layers.Dense(
            hidden_dim,
            kernel_initializer=initializer,
            dtype=self.dtype_policy,
            name="output_projection",
        )
        self.attention_dropout = keras.layers.Dropout(
            dropout, dtype=self.dtype_policy, name="attention_dropout"
        )

    def build(self, input_shape):
        self.query_key_value.build(input_shape)
        self.output_projection.build(input_shape[:-1] + (self.hidden_dim,))
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
            cache: optional tensor (B, 2, S, H, D) of cached keys and values.
            cache_index: int or scalar int tensor. Position of `inputs[:, 0]`
                in the cache.
            training: bool. Enables dropout.

        Returns:
            The output (B, T, C), and with a cache also the updated cache.
        """
        batch_size = tf.shape(inputs)[0]
        length = tf.shape(inputs)[1]
        qkv = self.query_key_value(inputs)  # (B, T, 3C)
        qkv = tf.reshape(
            qkv, [batch_size, length, 3, self.num_heads, self.head_dim]
        )  # (B, T, 3, H, D)
        query, key, value = tf.unstack(qkv, 3, axis=2)  # 3 x (B, T, H, D)

        if cache is not None:
            start = [0, cache_index, 0, 0]
            key = keras.ops.slice_update(cache[:, 0], start, key)  # (B, S, H, D)
            value = keras.ops.slice_update(cache[:, 1], start, value)  # (B, S, H, D)
            cache = tf.stack([key, value], axis=1)  # (B, 2, S, H, D)
        key_length = tf.shape(key)[1]

        query = tf.transpose(query, [0, 2, 1, 3])  # (B, H, T, D)
        key = tf.transpose(key, [0, 2, 3, 1])  # (B, H, D, S)
        value = tf.transpose(value, [0, 2, 1, 3])  # (B, H, S, D)
        scores = tf.matmul(query, key)  # (B, H, T, S)
        scores = tf.cast(scores, "float32") * (1.0 / math.sqrt(self.head_dim))

        query_positions = tf.range(length) + cache_index  # (T,)
        key_positions = tf.range(key_length)  # (S,)
        allowed = key_positions[tf.newaxis, :] <= query_positions[:, tf.newaxis]  # (T, S)
        allowed = allowed[tf.newaxis, tf.newaxis]  # (1, 1, T, S)
        if padding_mask is not None:
            keys_real = tf.cast(padding_mask, "bool")[:, tf.newaxis, tf.newaxis, :]
            allowed = tf.logical_and(allowed, keys_real)  # (B, 1, T, S)
        # A large finite negative rather than -inf: a fully masked row (a
        # left-padding query) then yields a uniform, finite distribution
        # instead of NaN.
        scores = tf.where(allowed, scores, -1e9)
        weights = tf.nn.softmax(scores, axis=-1)  # (B, H, T, S)
        weights = self.attention_dropout(weights, training=training)
        weights = tf.cast(weights, self.compute_dtype)

        attended = tf.matmul(weights, value)  # (B, H, T, D)
        attended = tf.transpose(attended, [0, 2, 1, 3])  # (B, T, H, D)
        attended = tf.reshape(attended, [batch_size, length, self.hidden_dim])  # (B, T, C)
        outputs = self.output_projection(attended)  # (B, T, C)
        if cache is not None:
            return outputs, cache
        return outputs

    def get_config(self):
        config = super().get_config()
        config.update(
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            dropout=self.dropout,
        )
        return config
