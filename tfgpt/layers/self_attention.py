"""Multi-head bidirectional self-attention, the encoder (BERT) layout."""

import math

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfgpt")
class SelfAttention(keras.layers.Layer):
    """Bidirectional multi-head self-attention (Vaswani et al. 2017).

    Every position attends to every real (non-padding) position. Queries,
    keys and values have their own dense layers, as in BERT and ALBERT, so
    their checkpoints map one tensor to one variable; heads have width
    `hidden_dim // num_heads`. Softmax runs in float32 under mixed precision.

    Args:
        hidden_dim: int. Input and output width; must be divisible by
            `num_heads`.
        num_heads: int. Number of attention heads.
        dropout: float. Dropout rate on the attention probabilities.

    Example:
    >>> layer = SelfAttention(hidden_dim=8, num_heads=2)
    >>> layer(tf.zeros((1, 3, 8)), padding_mask=tf.constant([[1, 1, 0]])).shape
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
        policy = self.dtype_policy

        def dense(name):
            return keras.layers.Dense(
                hidden_dim,
                kernel_initializer=keras.initializers.RandomNormal(stddev=0.02),
                dtype=policy,
                name=name,
            )

        self.query = dense("query")
        self.key = dense("key")
        self.value = dense("value")
        self.output_projection = dense("output_projection")
        self.attention_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="attention_dropout"
        )

    def build(self, input_shape):
        for layer in (self.query, self.key, self.value, self.output_projection):
            layer.build(input_shape)
        self.built = True

    def _split_heads(self, x, batch_size, length):
        x = tf.reshape(x, [batch_size, length, self.num_heads, self.head_dim])  # (B, T, H, D)
        return tf.transpose(x, [0, 2, 1, 3])  # (B, H, T, D)

    def call(self, inputs, padding_mask=None, training=None):
        """Attends over all of `inputs` (B, T, C).

        Args:
            inputs: float tensor (B, T, C).
            padding_mask: optional bool/int tensor (B, T), true at real
                tokens. Padding positions are never attended to; their own
                outputs are computed but meaningless.
            training: bool. Enables dropout.

        Returns:
            The output (B, T, C).
        """
        batch_size = tf.shape(inputs)[0]
        length = tf.shape(inputs)[1]
        query = self._split_heads(self.query(inputs), batch_size, length)  # (B, H, T, D)
        key = self._split_heads(self.key(inputs), batch_size, length)  # (B, H, T, D)
        value = self._split_heads(self.value(inputs), batch_size, length)  # (B, H, T, D)

        scores = tf.matmul(query, key, transpose_b=True)  # (B, H, T, T)
        scores = tf.cast(scores, "float32") * (1.0 / math.sqrt(self.head_dim))
        if padding_mask is not None:
            keys_real = tf.cast(padding_mask, "bool")[:, tf.newaxis, tf.newaxis, :]  # (B, 1, 1, T)
            # A large finite negative rather than -inf, so that an all-padding
            # row gives a uniform distribution instead of NaN.
            scores = tf.where(keys_real, scores, -1e9)
        weights = tf.nn.softmax(scores, axis=-1)  # (B, H, T, T)
        weights = self.attention_dropout(weights, training=training)
        weights = tf.cast(weights, self.compute_dtype)

        attended = tf.matmul(weights, value)  # (B, H, T, D)
        attended = tf.transpose(attended, [0, 2, 1, 3])  # (B, T, H, D)
        attended = tf.reshape(attended, [batch_size, length, self.hidden_dim])  # (B, T, C)
        return self.output_projection(attended)  # (B, T, C)

    def get_config(self):
        config = super().get_config()
        config.update(
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            dropout=self.dropout,
        )
        return config
