"""Token, position and segment embeddings with a layer norm (BERT, ALBERT, RoBERTa)."""

import keras
import tensorflow as tf

from tfgpt.layers.configured_layer import ConfiguredLayer


@keras.saving.register_keras_serializable(package="tfgpt")
class EncoderEmbedding(ConfiguredLayer):
    """Sums token, learned position and segment embeddings, then normalises.

    `layer_norm(token[ids] + position[0..T) + segment[segment_ids])`, then
    dropout: the input embedding of BERT and ALBERT. For ALBERT the width is
    the small `embedding_dim` (E); the backbone projects it to `hidden_dim`.
    With a `pad_id` (RoBERTa), positions skip the pad tokens as fairseq's
    `make_positions` does: the real tokens of a row read rows `pad_id + 1`,
    `pad_id + 2`, ... in order, wherever the pads are, and every pad token
    reads row `pad_id`.

    Args:
        vocabulary_size: int. Number of token ids.
        max_sequence_length: int. The longest input: rows of the position
            table, plus `pad_id + 1` with a `pad_id`.
        num_segments: int. Rows of the segment table.
        embedding_dim: int. Embedding width.
        dropout: float. Dropout rate applied after the layer norm.
        layer_norm_epsilon: float. Epsilon of the layer norm.
        pad_id: int or None. The padding token id that positions skip
            (RoBERTa); None: token t reads row t (BERT, ALBERT).

    Example:
    >>> layer = EncoderEmbedding(100, 16, 2, 8)
    >>> layer(tf.constant([[1, 2, 3]]), tf.constant([[0, 0, 1]])).shape
    TensorShape([1, 3, 8])
    """

    def __init__(
        self,
        vocabulary_size,
        max_sequence_length,
        num_segments,
        embedding_dim,
        dropout=0.0,
        layer_norm_epsilon=1e-12,
        pad_id=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.record_config(
            vocabulary_size=vocabulary_size,
            max_sequence_length=max_sequence_length,
            num_segments=num_segments,
            embedding_dim=embedding_dim,
            dropout=dropout,
            layer_norm_epsilon=layer_norm_epsilon,
            pad_id=pad_id,
        )
        self.token_embedding = self._embedding(vocabulary_size, embedding_dim, "token_embedding")
        first_position = 0 if pad_id is None else pad_id + 1
        self.position_embedding = self._embedding(
            max_sequence_length + first_position, embedding_dim, "position_embedding"
        )
        self.segment_embedding = self._embedding(num_segments, embedding_dim, "segment_embedding")
        self.embedding_norm = self._layer_norm(layer_norm_epsilon, "embedding_norm")
        self.embedding_dropout = self._dropout(dropout, "embedding_dropout")

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        self.position_embedding.build(input_shape)
        self.segment_embedding.build(input_shape)
        self.embedding_norm.build(tuple(input_shape) + (self.embedding_dim,))
        self.built = True

    def call(self, token_ids, segment_ids=None, training=None):
        """Embeds `token_ids` (B, T); `segment_ids` (B, T) default to 0.

        Returns:
            float tensor (B, T, embedding_dim).
        """
        sequence_length = token_ids.shape[1]
        if sequence_length is not None and sequence_length > self.max_sequence_length:
            raise ValueError(
                "The sequence is longer than the position table. Received: "
                f"sequence_length={sequence_length}, "
                f"max_sequence_length={self.max_sequence_length}"
            )
        length = tf.shape(token_ids)[1]
        # Unknown static length (a tf.function with shape None): the gather
        # below would fail with an opaque message instead.
        tf.debugging.assert_less_equal(
            length, self.max_sequence_length, message="sequence longer than max_sequence_length"
        )
        if self.pad_id is None:
            positions = tf.range(length)[tf.newaxis, :]  # (1, T)
        else:
            # RoBERTa: the running count of real tokens, pads sent to row pad_id.
            real = tf.cast(tf.not_equal(tf.cast(token_ids, "int32"), self.pad_id), "int32")
            positions = tf.cumsum(real, axis=1) * real + self.pad_id  # (B, T)
        embedded = self.token_embedding(token_ids) + self.position_embedding(positions)  # (B, T, E)
        if segment_ids is not None:
            # An id >= num_segments would read zeros on GPU, so check it here.
            tf.debugging.assert_less(
                tf.cast(segment_ids, "int32"),
                self.num_segments,
                message="segment id beyond num_segments",
            )
            embedded = embedded + self.segment_embedding(segment_ids)  # (B, T, E)
        else:
            segment_zero = self.segment_embedding(tf.zeros([1, 1], "int32"))  # (1, 1, E)
            embedded = embedded + segment_zero
        embedded = self.embedding_norm(embedded)
        return self.embedding_dropout(embedded, training=training)  # (B, T, E)
