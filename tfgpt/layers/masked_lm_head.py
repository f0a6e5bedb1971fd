"""Masked-language-model head: transform, layer norm, tied output projection."""

import keras
import tensorflow as tf

from tfgpt.layers.activated_dense import ActivatedDense
from tfgpt.layers.configured_layer import ConfiguredLayer


@keras.saving.register_keras_serializable(package="tfgpt")
class MaskedLMHead(ConfiguredLayer):
    """Predicts the original token at masked positions (Devlin et al. 2019).

    `logits = layer_norm(act(dense(h))) @ token_embedding.T + bias`: a dense
    layer to the width of the token embedding (H for BERT, E for ALBERT),
    the activation, a layer norm, then the token embedding matrix transposed
    (tied, as in BERT and ALBERT) plus a per-token bias. The embedding
    matrix is passed to `call` rather than owned, so that it stays a single
    variable of the backbone. Logits are float32 whatever the dtype policy.

    Args:
        vocabulary_size: int. Number of token ids (rows of the embedding).
        embedding_dim: int. Width of the token embedding.
        activation: str. `"gelu"`, `"gelu_tanh"` or `"relu"` (checked by
            `ActivatedDense`).
        layer_norm_epsilon: float. Epsilon of the layer norm.

    Example:
    >>> head = MaskedLMHead(vocabulary_size=10, embedding_dim=4)
    >>> table = tf.random.normal((10, 4))
    >>> head(tf.zeros((2, 5, 6)), table, mask_positions=tf.constant([[1, 3], [0, 0]])).shape
    TensorShape([2, 2, 10])
    """

    def __init__(
        self,
        vocabulary_size,
        embedding_dim,
        activation="gelu",
        layer_norm_epsilon=1e-12,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.record_config(
            vocabulary_size=vocabulary_size,
            embedding_dim=embedding_dim,
            activation=activation,
            layer_norm_epsilon=layer_norm_epsilon,
        )
        self.transform = self._dense(
            embedding_dim, "transform", dense_class=ActivatedDense, activation=activation
        )
        self.transform_norm = self._layer_norm(layer_norm_epsilon, "transform_norm")

    def build(self, input_shape):
        self.transform.build(input_shape)
        self.transform_norm.build(tuple(input_shape[:-1]) + (self.embedding_dim,))
        self.output_bias = self.add_weight(
            shape=(self.vocabulary_size,), initializer="zeros", name="output_bias"
        )
        self.built = True

    def call(self, inputs, token_embedding, mask_positions=None):
        """Returns float32 logits over the vocabulary.

        Args:
            inputs: float tensor (B, T, C), the encoder's sequence output.
            token_embedding: float tensor (V, E), the tied embedding matrix.
            mask_positions: optional int tensor (B, P) of the positions to
                predict (pad with any valid position and weight it 0 in the
                loss). Without it, every position is predicted.

        Returns:
            float32 tensor (B, P, V), or (B, T, V) without `mask_positions`.
        """
        x = inputs
        if mask_positions is not None:
            x = tf.gather(x, tf.cast(mask_positions, "int32"), batch_dims=1)  # (B, P, C)
        x = self.transform_norm(self.transform(x))  # (B, P, E)
        table = tf.cast(token_embedding, self.compute_dtype)  # (V, E)
        logits = tf.matmul(x, table, transpose_b=True)  # (B, P, V)
        logits = tf.cast(logits, "float32") + tf.cast(self.output_bias, "float32")
        return logits
