"""Classification head on the pooled [CLS] vector: dropout and a dense layer."""

import keras
import tensorflow as tf

from tfgpt.config.checks import require_fraction, require_int_at_least
from tfgpt.layers.configured_layer import ConfiguredLayer


@keras.saving.register_keras_serializable(package="tfgpt")
class ClassificationHead(ConfiguredLayer):
    """Maps a pooled sequence vector (B, C) to class logits (B, num_classes).

    Used for BERT's next-sentence prediction and ALBERT's sentence-order
    prediction (two classes each, Devlin et al. 2019; Lan et al. 2020) and
    for fine-tuned sequence classification (GLUE). Logits are float32
    whatever the dtype policy.

    Args:
        num_classes: int. Number of classes, at least 2.
        dropout: float. Dropout rate on the pooled input, in [0, 1).

    Example:
    >>> head = ClassificationHead(num_classes=3)
    >>> head(tf.zeros((2, 8))).shape
    TensorShape([2, 3])
    """

    def __init__(self, num_classes, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        require_int_at_least("num_classes", num_classes, 2)
        require_fraction("dropout", dropout)
        self.record_config(num_classes=num_classes, dropout=dropout)
        self.input_dropout = self._dropout(dropout, "input_dropout")
        self.classifier = self._dense(num_classes, "classifier")

    def build(self, input_shape):
        self.classifier.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        """Returns float32 logits (B, num_classes) for `inputs` (B, C)."""
        x = self.input_dropout(inputs, training=training)
        return tf.cast(self.classifier(x), "float32")  # (B, K)
