"""What the causal and the bidirectional self-attention layers share."""

import tensorflow as tf

from tfgpt.config.checks import require_divisible
from tfgpt.layers.configured_layer import ConfiguredLayer, normal_initializer
from tfgpt.parallel.tensor_parallel import SPLIT_RULES, current_slice

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
            `num_heads` unless `head_dim` is given.
        num_heads: int. Number of attention heads.
        dropout: float. Dropout rate on the attention probabilities.
        head_dim: int or None. Width of each head; None:
            `hidden_dim // num_heads`.
        output_bias: bool. A bias on the output projection.

    Built inside `tfgpt.parallel.tensor_parallel.slice_scope`, the layer
    holds `local_heads` of the heads (its slice): the projection to the
    heads is column-parallel, the output projection row-parallel (its
    partial products summed over the tensor group), and the attention
    dropout draws the slice's own masks.
    """

    def __init__(self, hidden_dim, num_heads, dropout=0.0, head_dim=None, output_bias=True,
                 **kwargs):
        super().__init__(**kwargs)
        if head_dim is None:
            require_divisible("hidden_dim", hidden_dim, "num_heads", num_heads)
        self.record_config(hidden_dim=hidden_dim, num_heads=num_heads, dropout=dropout,
                           head_dim=head_dim or hidden_dim // num_heads, output_bias=output_bias)
        self.tensor_slice = current_slice()
        self.local_heads = self._local(num_heads, "num_heads")
        # Width of the concatenated heads this layer holds.
        self.local_dim = self.local_heads * self.head_dim

    def _local(self, heads, what):
        """This slice's count of `heads` (all of them in a whole model)."""
        return self.tensor_slice.rows(heads, what)[1]

    def _heads_dense(self, groups, name, initializer=None, heads=None, use_bias=True):
        """The column-parallel projection to `groups` x this layer's heads
        (q, k, v: 3; k, v: 2), of `heads` heads each (default `num_heads`)."""
        initializer = initializer or normal_initializer()
        heads = heads or self.num_heads
        whole = (self.hidden_dim, groups * heads * self.head_dim)
        local = self._local(heads, "num_key_value_heads" if heads != self.num_heads
                            else "num_heads")
        return self._dense(
            groups * local * self.head_dim, name,
            self.tensor_slice.initializer(initializer, whole, SPLIT_RULES[f"{name}/kernel"]),
            use_bias=use_bias,
        )

    def _heads_input(self, inputs):
        """The input of the projection to the heads: f, under a tensor slice."""
        return self.tensor_slice.copy_to_group(inputs)

    def _add_output_layers(self, initializer=None):
        initializer = self.tensor_slice.initializer(
            initializer or normal_initializer(), (self.num_heads * self.head_dim, self.hidden_dim),
            SPLIT_RULES["output_projection/kernel"])
        self.output_projection = self._dense(self.hidden_dim, "output_projection", initializer,
                                             use_bias=self.output_bias)
        self.attention_dropout = self._dropout(self.dropout, "attention_dropout")
        if self.dropout > 0:
            self.tensor_slice.seed_dropout(self.attention_dropout)

    def _project_output(self, attended):
        """The output projection of the heads (B, T, local_dim) to (B, T, C)."""
        return self.tensor_slice.row_parallel(self.output_projection, attended)

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
        attended = tf.reshape(attended, [batch_size, length, self.local_dim])  # (B, T, C)
        return self._project_output(attended)  # (B, T, C)
