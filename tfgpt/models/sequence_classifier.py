"""Sequence classification: an encoder backbone and a head on its pooled output."""

import keras

from tfgpt.layers.classification_head import ClassificationHead
from tfgpt.models.encoder_backbone import EncoderBackbone
from tfgpt.models.encoder_inputs import pack_encoder_inputs, unpack_encoder_inputs


def check_encoder_backbone(backbone):
    """Raises ValueError unless `backbone` is a BERT or ALBERT backbone."""
    if not isinstance(backbone, EncoderBackbone):
        raise ValueError(
            "`backbone` must be a BertBackbone or an AlbertBackbone (for a "
            "pretrained `Bert`/`Albert`, pass its `.backbone`). "
            f"Received: backbone of type {type(backbone).__name__}"
        )


@keras.saving.register_keras_serializable(package="tfgpt")
class SequenceClassifier(keras.Model):
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
        super().__init__(**kwargs)
        check_encoder_backbone(backbone)
        self.backbone = backbone
        self.num_classes = num_classes
        self.dropout = dropout
        self.classification_head = ClassificationHead(
            num_classes, dropout=dropout, dtype=self.dtype_policy, name="classification_head"
        )
        self.build((None, None))

    def build(self, input_shape):
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        self.classification_head.build((input_shape[0], self.backbone.hidden_dim))
        self.built = True

    def call(self, inputs, training=None):
        """Returns float32 class logits (B, num_classes)."""
        token_ids, segment_ids, padding_mask, _ = unpack_encoder_inputs(inputs)
        outputs = self.backbone(
            pack_encoder_inputs(token_ids, segment_ids, padding_mask), training=training
        )
        return self.classification_head(outputs["pooled_output"], training=training)

    def get_config(self):
        config = super().get_config()
        config.update(
            backbone=keras.saving.serialize_keras_object(self.backbone),
            num_classes=self.num_classes,
            dropout=self.dropout,
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
