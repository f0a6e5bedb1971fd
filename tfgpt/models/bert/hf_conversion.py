"""BERT checkpoints in the transformers layout: the `config.json` keys and tensor names
that `tfgpt.convert_encoders` reads and writes (`tfgpt.models.encoder_family`).

transformers' `BertModel` keeps the backbone at the top level and its task
models under `bert.`; the masked-LM decoder is tied to the word embeddings
and its bias is `cls.predictions.bias`, as tfgpt's `MaskedLMHead` reads the
backbone's token embedding and owns `output_bias`.
"""

from tfgpt.convert_encoders import EncoderLayout

# The names under a block's prefix of `tfgpt.convert_encoders.BLOCK_PARTS`
# (RoBERTa's blocks are named alike).
BLOCK_PARTS = (
    "attention.self.query", "attention.self.key", "attention.self.value",
    "attention.output.dense", "attention.output.LayerNorm",
    "intermediate.dense", "output.dense", "output.LayerNorm",
)

LAYOUT = EncoderLayout(
    fields={},
    required={},
    block="encoder.layer.{index}",
    block_parts=BLOCK_PARTS,
    pooler="pooler.dense",
    masked_lm="cls.predictions",
    masked_lm_transform=("transform.dense", "transform.LayerNorm"),
    pair_classifier="cls.seq_relationship",
    sequence_classifier="classifier",
    classes="Bert",
)
