"""What the fine-tuned encoder models share: a backbone given to them, and a head."""

import keras

from tfgpt.models.encoder_backbone import EncoderBackbone
from tfgpt.models.encoder_inputs import pack_encoder_inputs, unpack_encoder_inputs
from tfgpt.models.layer_tree import LayerTree


def check_encoder_backbone(backbone):
    """Raises ValueError unless `backbone` is a BERT or ALBERT backbone."""
    if not isinstance(backbone, EncoderBackbone):
        raise ValueError(
            "`backbone` must be a BertBackbone or an AlbertBackbone (for a "
            "pretrained `Bert`/`Albert`, pass its `.backbone`). "
            f"Received: backbone of type {type(backbone).__name__}"
        )


class EncoderTaskModel(LayerTree, keras.Model):
    """A task head on a BERT or ALBERT backbone, usually a pretrained one.

    The backbone is a constructor argument (attribute `backbone`), saved
    inside `get_config()`. A subclass creates its head in `__init__` after
    `super().__init__(backbone, **kwargs)` and ends it with
    `self.build((None, None))`; it defines `_build_head(input_shape,
    hidden_dim)` and `_head(backbone_outputs, training)`.

    Inputs are the backbone's.
    """

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        check_encoder_backbone(backbone)
        self.backbone = backbone

    def build(self, input_shape):
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        self._build_head(tuple(input_shape), self.backbone.hidden_dim)
        self.built = True

    def call(self, inputs, training=None):
        token_ids, segment_ids, padding_mask, _ = unpack_encoder_inputs(inputs)
        outputs = self.backbone(
            pack_encoder_inputs(token_ids, segment_ids, padding_mask), training=training
        )
        return self._head(outputs, training)

    def get_config(self):
        config = super().get_config()
        config.update(backbone=keras.saving.serialize_keras_object(self.backbone))
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
