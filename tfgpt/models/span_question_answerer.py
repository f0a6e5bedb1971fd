"""Extractive question answering: an encoder backbone and a span head."""

import keras

from tfgpt.layers.span_head import SpanHead
from tfgpt.models.encoder_inputs import pack_encoder_inputs, unpack_encoder_inputs
from tfgpt.models.sequence_classifier import check_encoder_backbone


@keras.saving.register_keras_serializable(package="tfgpt")
class SpanQuestionAnswerer(keras.Model):
    """Predicts the answer span of a question in a passage (SQuAD).

    The input is `[CLS] question [SEP] passage [SEP]` with segment ids 0 then
    1 (`tfgpt.finetuning.squad.squad_features` builds it); a `SpanHead` scores
    each token as start and as end (Devlin et al. 2019, Section 4.2).
    `tfgpt.finetuning.squad.postprocess_predictions` turns the logits into text.

    Args:
        backbone: BertBackbone or AlbertBackbone.

    Inputs are the backbone's. Output: a dict with float32 `start_logits`
    and `end_logits`, each (B, T).

    Example:
    >>> backbone = AlbertBackbone.from_preset("albert-demo", num_layers=2)
    >>> SpanQuestionAnswerer(backbone)(tf.constant([[1, 5, 2]]))["start_logits"].shape
    TensorShape([1, 3])
    """

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        check_encoder_backbone(backbone)
        self.backbone = backbone
        self.span_head = SpanHead(dtype=self.dtype_policy, name="span_head")
        self.build((None, None))

    def build(self, input_shape):
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        self.span_head.build(tuple(input_shape) + (self.backbone.hidden_dim,))
        self.built = True

    def call(self, inputs, training=None):
        """Returns `{"start_logits": (B, T), "end_logits": (B, T)}` in float32."""
        token_ids, segment_ids, padding_mask, _ = unpack_encoder_inputs(inputs)
        outputs = self.backbone(
            pack_encoder_inputs(token_ids, segment_ids, padding_mask), training=training
        )
        start_logits, end_logits = self.span_head(outputs["sequence_output"])
        return {"start_logits": start_logits, "end_logits": end_logits}

    def get_config(self):
        config = super().get_config()
        config.update(backbone=keras.saving.serialize_keras_object(self.backbone))
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
