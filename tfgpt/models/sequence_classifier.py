"""Sequence classification: an encoder backbone and a head on its pooled output."""

import keras

from tfgpt.layers.classification_head import ClassificationHead
from tfgpt.models.encoder_task_model import EncoderTaskModel


@keras.saving.register_keras_serializable(package="tfgpt")
class SequenceClassifier(EncoderTaskModel):
    """Classifies a sentence or a sentence pair (GLUE, e.g. SST-2).

    Dropout and a dense layer on the backbone's pooled [CLS] vector
    (Devlin et al. 2019, Section 4.1). Start from a pretrained backbone:
    `SequenceClassifier(pretrained.backbone, num_classes=2)`.

    Args:
        backbone: BertBackbone or AlbertBackbone.
        num_classes: int. Number of labels, at least 2.
        dropout: float. Dropout rate on the pooled vector (BERT uses 0.1).

    Inputs are the backbone's. Output: float32 logits (B, num_classes).

    Example:
    >>> backbone = BertBackbone.from_preset("bert-demo", num_layers=2)
    >>> SequenceClassifier(backbone, num_classes=3)(tf.constant([[1, 5, 2]])).shape
    TensorShape([1, 3])
    """

    def __init__(self, backbone, num_classes, dropout=0.1, **kwargs):
        super().__init__(backbone, **kwargs)
        self.num_classes = num_classes
        self.dropout = dropout
        self.classification_head = ClassificationHead(
            num_classes, dropout=dropout, dtype=self.dtype_policy, name="classification_head"
        )
        self.build((None, None))

    def _build_head(self, input_shape, hidden_dim):
        self.classification_head.build((input_shape[0], hidden_dim))

    def _head(self, outputs, training):
        """Float32 class logits (B, num_classes)."""
        return self.classification_head(outputs["pooled_output"], training=training)

    def get_config(self):
        config = super().get_config()
        config.update(num_classes=self.num_classes, dropout=self.dropout)
        return config
