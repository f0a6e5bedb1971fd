"""Token embedding plus a learned absolute position embedding."""

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfgpt")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Sums a token embedding and a learned position embedding (GPT-2's wte + wpe).

    Args:
        vocabulary_size: int. Number of token ids.
        max_sequence_length: int. Rows of the position table: positions must
            stay below it.
        hidden_dim: int. Embedding width.
        dropout: float. Dropout rate applied to the sum.

    Example:
    >>> layer = TokenAndPositionEmbedding(100, 16, 8)
    >>> layer(tf.constant([[1, 2, 3]])).shape
    TensorShape([1, 3, 8])
    """

    def __init__(
        self, vocabulary_size, max_sequence_length, hidden_dim, dropout=0.0, **kwargs
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = vocabulary_size
        self.max_sequence_length = max_sequence_length
        self.hidden_dim = hidden_dim
        self.dropout = dropout
        initializer = keras.initializers.RandomNormal(stddev=0.02)
        self.token_embedding = keras.layers.Embedding(
            vocabulary_size,
            hidden_dim,
            embeddings_initializer=initializer,
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        self.position_embedding = keras.layers.Embedding(
            max_sequence_length,
            hidden_dim,
            embeddings_initializer=initializer,
            dtype=self.dtype_policy,
            name="position_embedding",
        )
        self.embedding_dropout = keras.layers.Dropout(
            dropout, dtype=self.dtype_policy, name="embedding_dropout"
        )

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        self.position_embedding.build(input_shape)
        self.built = True

    def call(self, token_ids, start_index=0, positions=None, training=None):
        """Embeds `token_ids` of shape (B, T).

        Args:
            token_ids: int tensor (B, T).
            start_index: int or scalar int tensor. Position of the first
                token (non-zero when decoding with a KV cache).
            positions: optional int tensor (B, T) of explicit positions, for
                left-padded batches; overrides `start_index`.
            training: bool. Enables dropout.
        """
        sequence_length = token_ids.shape[1]
        if (
            positions is None
            and sequence_length is not None
            and isinstance(start_index, int)
            and start_index + sequence_length > self.max_sequence_length
        ):
            raise ValueError(
                "The sequence is longer than the position table. Received: "
                f"sequence_length={sequence_length} (starting at position "
                f"{start_index}), max_sequence_length={self.max_sequence_length}"
            )
        if positions is None:
            length = tf.shape(token_ids)[1]
            positions = tf.range(length) + start_index  # (T,)
            positions = positions[tf.newaxis, :]  # (1, T)
        # Out-of-range positions would otherwise read zeros on some devices
        # and fail with an opaque gather error on others.
        tf.debugging.assert_less(
            tf.reduce_max(positions),
            self.max_sequence_length,
            message="position beyond max_sequence_length",
        )
        embedded = self.token_embedding(token_ids) + self.position_embedding(positions)
        return self.embedding_dropout(embedded, training=training)  # (B, T, C)

    def get_config(self):
        config = super().get_config()
        config.update(
            vocabulary_size=self.vocabulary_size,
            max_sequence_length=self.max_sequence_length,
            hidden_dim=self.hidden_dim,
            dropout=self.dropout,
        )
        return config
