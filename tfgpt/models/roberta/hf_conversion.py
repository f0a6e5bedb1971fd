"""RoBERTa checkpoints in the transformers layout: the `config.json` keys and tensor names
that `tfgpt.convert_encoders` reads and writes (`tfgpt.models.encoder_family`).

RoBERTa is BERT's encoder, its blocks named as BERT's. Its
`max_position_embeddings` counts the `pad_token_id + 1` rows before the
first real token's; tfgpt's `max_sequence_length` does not
(`RobertaConfig.first_position`). `RobertaForMaskedLM` has no pooler
(`Roberta`'s unused one is left out) and a masked-LM head that always applies
exact GELU. `RobertaForSequenceClassification`'s head (`classifier.dense`,
`classifier.out_proj`) has its own layout, which tfgpt neither reads nor
writes.
"""

from tfgpt.convert_encoders import EncoderLayout
from tfgpt.models.bert.hf_conversion import BLOCK_PARTS

LAYOUT = EncoderLayout(
    fields={"pad_id": ("pad_token_id", None)},
    required={"hidden_act": "gelu"},
    block="encoder.layer.{index}",
    block_parts=BLOCK_PARTS,
    pooler="pooler.dense",
    masked_lm="lm_head",
    masked_lm_transform=("dense", "layer_norm"),
    pair_classifier=None,
    sequence_classifier=None,
    classes="Roberta",
)
