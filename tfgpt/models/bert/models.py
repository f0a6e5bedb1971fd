"""BERT: a bidirectional transformer encoder, and its pretraining heads."""

import keras

from tfgpt.config import BertConfig
from tfgpt.models.encoder_backbone import EncoderBackbone
from tfgpt.models.encoder_pretraining_model import EncoderPretrainingModel


@keras.saving.register_keras_serializable(package="tfgpt")
class BertBackbone(EncoderBackbone):
    """BERT encoder: embeddings, `num_layers` encoder blocks and a pooler.

    Token, position and segment embeddings summed and layer-normalised,
    post-LN encoder blocks (pre-LN plus a final layer norm with
    `norm_first=True`), and a pooler `tanh(dense(h[:, 0]))` on the first
    ([CLS]) token (Devlin et al. 2019). Heads are added by `Bert`
    (pretraining), `SequenceClassifier` and `SpanQuestionAnswerer`. Inputs
    and outputs are those of `EncoderBackbone`.

    Args:
        The fields of `tfgpt.config.BertConfig`, as keyword arguments, and
        Keras's (`name`, `dtype`, ...). Each field is also an attribute.

    Example:
    >>> backbone = BertBackbone.from_preset("bert-demo", num_layers=2)
    >>> outputs = backbone({"token_ids": tf.constant([[1, 5, 2, 0]]),
    ...                     "padding_mask": tf.constant([[1, 1, 1, 0]])})
    >>> outputs["sequence_output"].shape, outputs["pooled_output"].shape
    (TensorShape([1, 4, 192]), TensorShape([1, 192]))
    """

    config_class = BertConfig


@keras.saving.register_keras_serializable(package="tfgpt")
class Bert(EncoderPretrainingModel):
    """BERT with its pretraining heads: masked LM and next-sentence prediction.

    A `BertBackbone` (attribute `backbone`), a `MaskedLMHead` tied to the
    token embedding, and a two-class `ClassificationHead` on the pooled
    output for next-sentence prediction (Devlin et al. 2019), without
    dropout before it (as released). Outputs: the backbone's, `mlm_logits`
    (B, P, V) and `nsp_logits` (B, 2). Class 1 of `nsp_logits` means "the
    second segment is a random sentence" (transformers' convention).

    Args:
        The fields of `tfgpt.config.BertConfig`, as for `BertBackbone`.

    Example:
    >>> model = Bert.from_preset("bert-demo", num_layers=2)
    >>> outputs = model({"token_ids": tf.constant([[1, 4, 3, 2]]),
    ...                  "mask_positions": tf.constant([[2]])})
    >>> outputs["mlm_logits"].shape, outputs["nsp_logits"].shape
    (TensorShape([1, 1, 2000]), TensorShape([1, 2]))
    """

    config_class = BertConfig
    backbone_class = BertBackbone
    pair_task = "nsp"
    pair_head_name = "next_sentence_head"
