"""What BERT's, ALBERT's and RoBERTa's pretraining models share: a backbone and heads."""

import dataclasses

from tfgpt.layers.classification_head import ClassificationHead
from tfgpt.layers.masked_lm_head import MaskedLMHead
from tfgpt.models.configured_model import ConfiguredModel
from tfgpt.models.encoder_inputs import pack_encoder_inputs, unpack_encoder_inputs


class EncoderPretrainingModel(ConfiguredModel):
    """An encoder backbone with a masked-LM head and a sentence-pair head.

    The backbone (`backbone_class`, attribute `backbone`) gets the same
    config; a `MaskedLMHead` transforms to the width of the token embedding
    and is tied to it (Devlin et al. 2019); a two-class `ClassificationHead`
    on the pooled output predicts the sentence-pair task `pair_task` (its
    attribute is `pair_head_name`). A family without a sentence-pair task
    (`pair_task` None: RoBERTa) has the masked-LM head only.

    Inputs: the backbone's dict plus optionally `mask_positions` (B, P), the
    positions whose original token the masked LM predicts; without it the
    masked LM scores every position. Outputs: a dict with the backbone's
    `sequence_output` and `pooled_output`, `mlm_logits` (B, P, V) and, with
    a pair task, `{pair_task}_logits` (B, 2), logits in float32.
    """

    backbone_class = None
    # The sentence-pair task ("nsp", "sop"), the attribute of its head, and
    # whether the head applies dropout to the pooled vector first.
    pair_task = None
    pair_head_name = None
    pair_head_dropout = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        self.backbone = self.backbone_class(
            **dataclasses.asdict(self.config), dtype=policy, name="backbone"
        )
        self.masked_lm_head = MaskedLMHead(
            self.vocabulary_size,
            self.backbone.embedding_width,
            activation=self.activation,
            layer_norm_epsilon=self.layer_norm_epsilon,
            dtype=policy,
            name="masked_lm_head",
        )
        if self.pair_task is not None:
            pair_head = ClassificationHead(
                2,
                dropout=self.dropout if self.pair_head_dropout else 0.0,
                dtype=policy,
                name=self.pair_head_name,
            )
            setattr(self, self.pair_head_name, pair_head)
        self.build((None, None))

    def build(self, input_shape):
        if isinstance(input_shape, dict):
            input_shape = input_shape["token_ids"]
        self.masked_lm_head.build(tuple(input_shape) + (self.hidden_dim,))
        if self.pair_task is not None:
            getattr(self, self.pair_head_name).build((input_shape[0], self.hidden_dim))
        self.built = True

    def call(self, inputs, training=None):
        """Returns the backbone outputs plus `mlm_logits` and any pair task's logits."""
        token_ids, segment_ids, padding_mask, extras = unpack_encoder_inputs(
            inputs, extra_keys=("mask_positions",)
        )
        outputs = self.backbone(
            pack_encoder_inputs(token_ids, segment_ids, padding_mask), training=training
        )
        mlm_logits = self.masked_lm_head(
            outputs["sequence_output"],
            self.backbone.token_embedding,
            mask_positions=extras["mask_positions"],
        )
        outputs = {**outputs, "mlm_logits": mlm_logits}
        if self.pair_task is not None:
            outputs[f"{self.pair_task}_logits"] = getattr(self, self.pair_head_name)(
                outputs["pooled_output"], training=training
            )
        return outputs
