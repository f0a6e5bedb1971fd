"""ALBERT: BERT with factorised embeddings and cross-layer parameter sharing."""

import keras

from tfgpt.config import AlbertConfig
from tfgpt.models.encoder_backbone import EncoderBackbone
from tfgpt.models.encoder_pretraining_model import EncoderPretrainingModel


@keras.saving.register_keras_serializable(package="tfgpt")
class AlbertBackbone(EncoderBackbone):
    """ALBERT encoder (Lan et al. 2020): a BERT encoder with fewer parameters.

    Two changes to `BertBackbone`:
    - Factorised embedding parameterisation: token, position and segment
      embeddings have width `embedding_dim` (E, 128 in every published
      size), layer-normalised and then projected to `hidden_dim` (H) by
      one dense layer (`embedding_projection`), so the vocabulary costs
      V*E + E*H instead of V*H.
    - Cross-layer parameter sharing: only `num_groups` encoder blocks hold
      parameters (attribute `blocks`); layer i applies
      `blocks[i // (num_layers // num_groups)]`. ALBERT uses one group, so
      every layer is the same block.

    Inputs and outputs are those of `BertBackbone`.

    Args:
        The fields of `tfgpt.config.AlbertConfig`, as keyword arguments, and
        Keras's (`name`, `dtype`, ...). Each field is also an attribute.

    Example:
    >>> backbone = AlbertBackbone.from_preset("albert-demo", num_layers=2)
    >>> backbone(tf.constant([[1, 5, 2]]))["sequence_output"].shape
    TensorShape([1, 3, 192])
    """

    config_class = AlbertConfig


@keras.saving.register_keras_serializable(package="tfgpt")
class Albert(EncoderPretrainingModel):
    """ALBERT with its pretraining heads: masked LM and sentence-order prediction.

    An `AlbertBackbone` (attribute `backbone`), a `MaskedLMHead` that
    transforms to width E and is tied to the E-wide token embedding, and a
    two-class `ClassificationHead` with dropout on the pooled output for
    sentence-order prediction (Lan et al. 2020, Section 3.1). Outputs: the
    backbone's, `mlm_logits` (B, P, V) and `sop_logits` (B, 2). Class 1 of
    `sop_logits` means "the two segments are swapped" (transformers'
    `sentence_order_label` convention).

    Args:
        The fields of `tfgpt.config.AlbertConfig`, as for `AlbertBackbone`.

    Example:
    >>> model = Albert.from_preset("albert-demo", num_layers=2)
    >>> model({"token_ids": tf.constant([[1, 4, 3, 2]])})["sop_logits"].shape
    TensorShape([1, 2])
    """

    config_class = AlbertConfig
    backbone_class = AlbertBackbone
    pair_task = "sop"
    pair_head_name = "sentence_order_head"
    pair_head_dropout = True
