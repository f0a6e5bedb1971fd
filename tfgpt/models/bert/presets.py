"""BERT's presets: BertConfig's defaults are bert-base's, the presets add the sizes."""


def sized(num_layers, hidden_dim, num_heads, **fields):
    """A BERT shape: the feed-forward width 4H (every encoder family's presets use it)."""
    return {"num_layers": num_layers, "num_heads": num_heads, "hidden_dim": hidden_dim,
            "intermediate_dim": 4 * hidden_dim, **fields}


# Parameter counts of the backbones (embeddings, blocks, pooler; no
# pretraining heads), asserted as exact integers in tests/test_bert.py and
# equal to transformers' BertModel of the same shape: bert-base 109,482,240
# ("110M"), bert-large 335,141,888 ("340M").
PRESETS = {
    # Sized for a 2-core CPU, like gpt-demo.
    "bert-demo": sized(4, 192, 4, vocabulary_size=2000, max_sequence_length=128, dropout=0.0),
    "bert-base": sized(12, 768, 12),
    "bert-large": sized(24, 1024, 16),
}
