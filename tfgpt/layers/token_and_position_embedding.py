"""Token embedding plus a learned absolute position embedding."""

import keras
import tensorflow as tf

from tfgpt.layers.configured_layer import ConfiguredLayer, normal_initializer
from tfgpt.parallel.tensor_parallel import SPLIT_RULES, current_slice


@keras.saving.register_keras_serializable(package="tfgpt")
class TokenAndPositionEmbedding(ConfiguredLayer):
    """Sums a token embedding and a learned position embedding (GPT-2's wte + wpe).

    Args:
        vocabulary_size: int. Number of token ids.
        max_sequence_length: int. Rows of the position table: positions must
            stay below it.
        hidden_dim: int. Embedding width.
        dropout: float. Dropout rate applied to the sum.
        learned_positions: bool. Add the position table's rows; False
            embeds tokens only (positions enter the attention instead:
            rotary embeddings).

    Built inside `tfgpt.parallel.tensor_parallel.slice_scope`, the token
    table holds the slice's `vocabulary_size / T` rows (vocabulary-parallel:
    each rank looks up the ids it holds, the sum over the group gives every
    rank every row); the position table is replicated.

    Example:
    >>> layer = TokenAndPositionEmbedding(100, 16, 8)
    >>> layer(tf.constant([[1, 2, 3]])).shape
    TensorShape([1, 3, 8])
    """

    def __init__(
        self, vocabulary_size, max_sequence_length, hidden_dim, dropout=0.0,
        learned_positions=True, **kwargs
    ):
        super().__init__(**kwargs)
        self.record_config(
            vocabulary_size=vocabulary_size,
            max_sequence_length=max_sequence_length,
            hidden_dim=hidden_dim,
            dropout=dropout,
            learned_positions=learned_positions,
        )
        initializer = normal_initializer()
        self.tensor_slice = current_slice()
        self.token_embedding = self._embedding(
            self.tensor_slice.rows(vocabulary_size, "vocabulary_size")[1], hidden_dim,
            "token_embedding",
            self.tensor_slice.initializer(initializer, (vocabulary_size, hidden_dim),
                                          SPLIT_RULES["token_embedding/embeddings"]),
        )
        self.position_embedding = self._embedding(
            max_sequence_length, hidden_dim, "position_embedding", initializer
        ) if learned_positions else None
        self.embedding_dropout = self._dropout(dropout, "embedding_dropout")

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        if self.position_embedding is not None:
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
        tokens = self.tensor_slice.embed_tokens(self.token_embedding, token_ids)  # (B, T, C)
        if self.position_embedding is None:
            return self.embedding_dropout(tokens, training=training)  # (B, T, C)
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
        if positions is not None:
            positions = tf.cast(positions, "int32")  # int64 from NumPy, say
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
        embedded = tokens + self.position_embedding(positions)
        return self.embedding_dropout(embedded, training=training)  # (B, T, C)
