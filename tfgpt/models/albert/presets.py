"""ALBERT's presets: AlbertConfig's defaults are albert-base v2's (E = 128, one shared block)."""

from tfgpt.models.bert.presets import sized

# Backbone parameter counts, asserted in tests/test_albert.py and equal to
# transformers' AlbertModel of the same shape: albert-base 11,683,584 ("12M"),
# albert-large 17,683,968 ("18M"), albert-xlarge 58,724,864 ("60M"),
# albert-xxlarge 222,595,584 (the paper's Table 1 says 235M; the released
# architecture it describes counts 222.6M). Lan et al. 2020, Table 1, as
# released (v2): E = 128, all layers share one block.
PRESETS = {
    "albert-demo": sized(4, 192, 4, vocabulary_size=2000, max_sequence_length=128,
                         embedding_dim=64),
    "albert-base": sized(12, 768, 12),
    "albert-large": sized(24, 1024, 16),
    # The released xlarge uses 16 heads of width 128, not the paper's H/64.
    "albert-xlarge": sized(24, 2048, 16),
    "albert-xxlarge": sized(12, 4096, 64),
}
