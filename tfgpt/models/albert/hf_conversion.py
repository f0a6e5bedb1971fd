"""ALBERT checkpoints in the transformers layout: the `config.json` keys and tensor names
that `tfgpt.convert_encoders` reads and writes (`tfgpt.models.encoder_family`).

ALBERT stores `num_hidden_groups` shared layers under
`albert_layer_groups.{g}.albert_layers.0`; they fill `backbone.blocks[g]`.
The factorised embeddings' projection is
`encoder.embedding_hidden_mapping_in`. tfgpt's groups hold one layer each
(`inner_group_num` 1).
"""

from tfgpt.convert_encoders import EncoderLayout

LAYOUT = EncoderLayout(
    fields={"embedding_dim": ("embedding_size", None), "num_groups": ("num_hidden_groups", 1)},
    required={"inner_group_num": 1},
    block="encoder.albert_layer_groups.{index}.albert_layers.0",
    block_parts=(
        "attention.query", "attention.key", "attention.value",
        "attention.dense", "attention.LayerNorm",
        "ffn", "ffn_output", "full_layer_layer_norm",
    ),
    pooler="pooler",
    masked_lm="predictions",
    masked_lm_transform=("dense", "LayerNorm"),
    pair_classifier="sop_classifier.classifier",
    sequence_classifier="classifier",
    classes="Albert",
)
