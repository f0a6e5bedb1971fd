"""What the causal and the bidirectional self-attention layers share."""

import keras
import tensorflow as tf

from tfgpt.config.checks import require_divisible
from tfgpt.layers.configured_layer import ConfiguredLayer

# The score of a key a query may not attend to: a large finite negative
# rather than -inf, so that a row with no such key (a padding query) gives a
# uniform, finite distribution instead of NaN.
MASKED_SCORE = -1e9


class SelfAttentionBase(ConfiguredLayer):
    """Multi-head self-attention's shared parts (Vaswani et al. 2017).

    Heads of width `hidden_dim // num_heads`, dropout on the attention
    probabilities and the projection of the concatenated heads back to
    `hidden_dim`. A subclass creates its query, key and value projections,
    then calls `_add_output_layers()` (so that the variables keep the order
    in which checkpoints list them), and in `call` hands its attention
    probabilities and values to `_attend`.

    Args:
        hidden_dim: int. Input and output width; must be divisible by
            `num_heads`.
        num_heads: int. Number of attention heads.
        dropout: float. Dropout rate on the attention probabilities.
    """

    def __init__(self, hidden_dim, num_heads, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        require_divisible("hidden_dim", hidden_dim, "num_heads", num_heads)
        self.record_config(hidden_dim=hidden_dim, num_heads=num_heads, dropout=dropout)
        self.head_dim = hidden_dim // num_heads

    def _add_output_layers(self, initializer=None):
        self.output_projection = self._dense(self.hidden_dim, "output_projection", initializer)
        self.attention_dropout = self._dropout(self.dropout, "attention_dropout")

    @staticmethod
    def _keys_real(padding_mask):
        """(B, 1, 1, S) bool: true at the real key positions of `padding_mask` (B, S)."""
        return tf.cast(padding_mask, "bool")[:, tf.newaxis, tf.newaxis, :]

    def _attend(self, weights, value, batch_size, length, training):
        """The output (B, T, C) for probabilities (B, H, T, S) and values (B, H, S, D)."""
        weights = self.attention_dropout(weights, training=training)
        weights = tf.cast(weights, self.compute_dtype)
        attended = tf.matmul(weights, value)  # (B, H, T, D)
        attended = tf.transpose(attended, [0, 2, 1, 3])  # (B, T, H, D)
        attended = tf.reshape(attended, [batch_size, length, self.hidden_dim])  # (B, T, C)
        return self.output_projection(attended)  # (B, T, C)
