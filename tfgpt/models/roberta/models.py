"""RoBERTa: BERT's encoder with positions that skip padding, pretrained by masked LM alone."""

import keras

from tfgpt.config import RobertaConfig
from tfgpt.models.encoder_backbone import EncoderBackbone
from tfgpt.models.encoder_pretraining_model import EncoderPretrainingModel


@keras.saving.register_keras_serializable(package="tfgpt")
class RobertaBackbone(EncoderBackbone):
    """RoBERTa encoder (Liu et al. 2019): BERT's, with fairseq's positions.

    `BertBackbone` with one change: a token's position is the number of
    non-pad tokens up to and including it, counted from `pad_id + 1`, and a
    pad token reads row `pad_id` (so the table has `max_sequence_length +
    pad_id + 1` rows: 514 in the released models). Positions come from
    `token_ids`, as in transformers' `RobertaModel`, so pads must be
    `pad_id` wherever they are. The released models have one segment
    (`num_segments` 1), layer-norm epsilon 1e-5 and GPT-2's byte-level BPE
    vocabulary with `<s>` 0, `<pad>` 1, `</s>` 2. The pooler is
    `RobertaModel`'s. Inputs and outputs are those of `EncoderBackbone`.

    Args:
        The fields of `tfgpt.config.RobertaConfig`, as keyword arguments, and
        Keras's (`name`, `dtype`, ...). Each field is also an attribute.

    Example:
    >>> backbone = RobertaBackbone.from_preset("roberta-demo", num_layers=2)
    >>> outputs = backbone({"token_ids": tf.constant([[0, 5, 2, 1]]),
    ...                     "padding_mask": tf.constant([[1, 1, 1, 0]])})
    >>> outputs["sequence_output"].shape, outputs["pooled_output"].shape
    (TensorShape([1, 4, 192]), TensorShape([1, 192]))
    """

    config_class = RobertaConfig


@keras.saving.register_keras_serializable(package="tfgpt")
class Roberta(EncoderPretrainingModel):
    """RoBERTa with its pretraining head: the masked LM alone, no sentence-pair task.

    A `RobertaBackbone` (attribute `backbone`) and a `MaskedLMHead` (dense,
    GELU, layer norm, the token embedding transposed plus a bias: the
    `lm_head` of transformers' `RobertaForMaskedLM`). Liu et al. 2019
    (Section 4.2) drop next-sentence prediction. Outputs: the backbone's
    and `mlm_logits` (B, P, V). The backbone's pooler is kept (its
    `pooled_output` serves fine-tuning) though the masked LM does not use it.

    Args:
        The fields of `tfgpt.config.RobertaConfig`, as for `RobertaBackbone`.

    Example:
    >>> model = Roberta.from_preset("roberta-demo", num_layers=2)
    >>> outputs = model({"token_ids": tf.constant([[0, 4, 3, 2]]),
    ...                  "mask_positions": tf.constant([[2]])})
    >>> outputs["mlm_logits"].shape
    TensorShape([1, 1, 2000])
    """

    config_class = RobertaConfig
    backbone_class = RobertaBackbone
