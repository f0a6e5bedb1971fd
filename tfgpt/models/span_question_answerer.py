"""Extractive question answering: an encoder backbone and a span head."""

import keras

from tfgpt.layers.span_head import SpanHead
from tfgpt.models.encoder_task_model import EncoderTaskModel


@keras.saving.register_keras_serializable(package="tfgpt")
class SpanQuestionAnswerer(EncoderTaskModel):
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
        super().__init__(backbone, **kwargs)
        self.span_head = SpanHead(dtype=self.dtype_policy, name="span_head")
        self.build((None, None))

    def _build_head(self, input_shape, hidden_dim):
        self.span_head.build(input_shape + (hidden_dim,))

    def _head(self, outputs, training):
        """`{"start_logits": (B, T), "end_logits": (B, T)}` in float32."""
        start_logits, end_logits = self.span_head(outputs["sequence_output"])
        return {"start_logits": start_logits, "end_logits": end_logits}
