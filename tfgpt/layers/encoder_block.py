"""One encoder block: bidirectional self-attention and a feed-forward network."""

import keras

from tfgpt.layers.activated_dense import ActivatedDense
from tfgpt.layers.layer_norm import LayerNorm
from tfgpt.layers.self_attention import SelfAttention
from tfgpt.layers.transformer_block import _ACTIVATIONS  # One table for both block kinds.


@keras.saving.register_keras_serializable(package="tfgpt")
class EncoderBlock(keras.layers.Layer):
    """A transformer encoder block with residual connections.

    Post-layer-norm (`norm_first=False`, BERT and ALBERT):
        x = norm1(x + dropout(attention(x)))
        x = norm2(x + dropout(feedforward(x)))
    Pre-layer-norm (`norm_first=True`, Xiong et al. 2020):
        x = x + dropout(attention(norm1(x)))
        x = x + dropout(feedforward(norm2(x)))

    The sublayers have the names of `TransformerBlock`'s; only the attention
    differs (bidirectional, separate query/key/value projections).

    Args:
        hidden_dim: int. Width of the residual stream.
        num_heads: int. Attention heads; must divide `hidden_dim`.
        intermediate_dim: int. Width of the feed-forward hidden layer.
        dropout: float. Rate for attention probabilities and both residual
            branches.
        activation: str. `"gelu"`, `"gelu_tanh"` or `"relu"`.
        norm_first: bool. Pre-LN when True, post-LN when False.
        layer_norm_epsilon: float. Epsilon of both layer norms.

    Example:
    >>> block = EncoderBlock(hidden_dim=8, num_heads=2, intermediate_dim=32)
    >>> block(keras.ops.zeros((1, 3, 8))).shape
    TensorShape([1, 3, 8])
    """

    def __init__(
        self,
        hidden_dim,
        num_heads,
        intermediate_dim,
        dropout=0.0,
        activation="gelu",
        norm_first=False,
        layer_norm_epsilon=1e-12,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {tuple(_ACTIVATIONS)}. "
                f"Received: activation={activation!r}"
            )
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.activation = activation
        self.norm_first = norm_first
        self.layer_norm_epsilon = layer_norm_epsilon
        initializer = keras.initializers.RandomNormal(stddev=0.02)
        policy = self.dtype_policy
        self.attention_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=policy, name="attention_norm"
        )
        self.attention = SelfAttention(
            hidden_dim, num_heads, dropout=dropout, dtype=policy, name="attention"
        )
        self.attention_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="attention_dropout"
        )
        self.feedforward_norm = LayerNorm(
            epsilon=layer_norm_epsilon, dtype=policy, name="feedforward_norm"
        )
        self.feedforward_intermediate = ActivatedDense(
            intermediate_dim,
            activation=activation,
            kernel_initializer=initializer,
            dtype=policy,
            name="feedforward_intermediate",
        )
        self.feedforward_output = keras.layers.Dense(
            hidden_dim,
            kernel_initializer=initializer,
            dtype=policy,
            name="feedforward_output",
        )
        self.feedforward_dropout = keras.layers.Dropout(
            dropout, dtype=policy, name="feedforward_dropout"
        )

    def build(self, input_shape):
        self.attention_norm.build(input_shape)
        self.attention.build(input_shape)
        self.feedforward_norm.build(input_shape)
        self.feedforward_intermediate.build(input_shape)
        self.feedforward_output.build(input_shape[:-1] + (self.intermediate_dim,))
        self.built = True

    def _feedforward(self, x, training):
        x = self.feedforward_intermediate(x)  # (B, T, I)
        x = self.feedforward_output(x)  # (B, T, C)
        return self.feedforward_dropout(x, training=training)

    def call(self, inputs, padding_mask=None, training=None):
        """Applies the block to `inputs` (B, T, C); `padding_mask` (B, T) marks real tokens."""
        x = inputs
        attention_input = self.attention_norm(x) if self.norm_first else x
        attended = self.attention(attention_input, padding_mask=padding_mask, training=training)
        x = x + self.attention_dropout(attended, training=training)
        if self.norm_first:
            return x + self._feedforward(self.feedforward_norm(x), training)
        x = self.attention_norm(x)
        return self.feedforward_norm(x + self._feedforward(x, training))

    def get_config(self):
        config = super().get_config()
        config.update(
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            intermediate_dim=self.intermediate_dim,
            dropout=self.dropout,
            activation=self.activation,
            norm_first=self.norm_first,
            layer_norm_epsilon=self.layer_norm_epsilon,
        )
        return config
