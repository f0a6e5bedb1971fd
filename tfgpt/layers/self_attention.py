"""Multi-head bidirectional self-attention, the encoder (BERT) layout."""

import math

import keras
import tensorflow as tf

from tfgpt.layers.self_attention_base import MASKED_SCORE, SelfAttentionBase


@keras.saving.register_keras_serializable(package="tfgpt")
class SelfAttention(SelfAttentionBase):
    """Bidirectional multi-head self-attention (Vaswani et al. 2017).

    Every position attends to every real (non-padding) position. Queries,
    keys and values have their own dense layers, as in BERT and ALBERT, so
    their checkpoints map one tensor to one variable; heads have width
    `hidden_dim // num_heads`. Softmax runs in float32 under mixed precision.

    Args:
        hidden_dim, num_heads, dropout: those of `SelfAttentionBase`.

    Example:
    >>> layer = SelfAttention(hidden_dim=8, num_heads=2)
    >>> layer(tf.zeros((1, 3, 8)), padding_mask=tf.constant([[1, 1, 0]])).shape
    TensorShape([1, 3, 8])
    """

    def __init__(self, hidden_dim, num_heads, dropout=0.0, **kwargs):
        super().__init__(hidden_dim, num_heads, dropout=dropout, **kwargs)
        if self.tensor_slice.size > 1:
            raise ValueError(
                "--tensor-parallel splits GPT's causal attention only; the encoders' "
                "(BERT, ALBERT) layers, embeddings and heads are not split"
            )
        self.query = self._dense(hidden_dim, "query")
        self.key = self._dense(hidden_dim, "key")
        self.value = self._dense(hidden_dim, "value")
        self._add_output_layers()

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
            scores = tf.where(self._keys_real(padding_mask), scores, MASKED_SCORE)
        weights = tf.nn.softmax(scores, axis=-1)  # (B, H, T, T)
        return self._attend(weights, value, batch_size, length, training)  # (B, T, C)
