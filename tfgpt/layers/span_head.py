"""Span head for extractive question answering: start and end logits per token."""

import keras
import tensorflow as tf

from tfgpt.layers.configured_layer import ConfiguredLayer


@keras.saving.register_keras_serializable(package="tfgpt")
class SpanHead(ConfiguredLayer):
    """Scores every token as the start and as the end of the answer span.

    One dense layer of width 2 on the sequence output (Devlin et al. 2019,
    Section 4.2; transformers' `qa_outputs`). The answer is the span
    (i, j), i <= j, maximising `start_logits[i] + end_logits[j]`; position 0
    ([CLS]) stands for "no answer" in SQuAD v2.0. Logits are float32.

    Args:
        None beyond the standard layer keyword arguments.

    Example:
    >>> start_logits, end_logits = SpanHead()(tf.zeros((2, 5, 8)))
    >>> start_logits.shape
    TensorShape([2, 5])
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.span_logits = self._dense(2, "span_logits")

    def build(self, input_shape):
        self.span_logits.build(input_shape)
        self.built = True

    def call(self, inputs):
        """Returns `(start_logits, end_logits)`, each float32 (B, T), for `inputs` (B, T, C)."""
        logits = tf.cast(self.span_logits(inputs), "float32")  # (B, T, 2)
        start_logits, end_logits = tf.unstack(logits, 2, axis=-1)  # 2 x (B, T)
        return start_logits, end_logits
