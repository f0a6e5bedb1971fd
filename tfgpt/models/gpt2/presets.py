"""GPT-2's presets (and tfgpt's own small GPTs): GPTConfig's defaults are GPT-2's switches."""


def _sized(num_layers, hidden_dim, num_heads, **fields):
    """A GPT-2 shape: the feed-forward width 4H."""
    return {"num_layers": num_layers, "num_heads": num_heads, "hidden_dim": hidden_dim,
            "intermediate_dim": 4 * hidden_dim, **fields}


# Published parameter counts of the GPT-2 family (tied embeddings): 124M,
# 355M, 774M and 1558M (Radford et al. 2019, as counted by the released
# checkpoints). tests/test_gpt.py asserts the exact integers.
PRESETS = {
    # Sized for a 2-core CPU: about 2M parameters, trains in minutes.
    "gpt-demo": _sized(4, 192, 4, vocabulary_size=2000, max_sequence_length=128),
    # nanoGPT's character-level Shakespeare shape (6 layers, 6 heads, 384).
    "gpt-mini": _sized(6, 384, 6, vocabulary_size=2000, max_sequence_length=256),
    "gpt2-small": _sized(12, 768, 12, dropout=0.1),
    "gpt2-medium": _sized(24, 1024, 16, dropout=0.1),
    "gpt2-large": _sized(36, 1280, 20, dropout=0.1),
    "gpt2-xl": _sized(48, 1600, 25, dropout=0.1),
}
