"""GPT-J presets: GPT-J's switches of GPTConfig at its published shape and a demo size."""


def _gptj(num_layers, hidden_dim, num_heads, rotary_dim, **fields):
    """One norm feeding attention and the feed-forward network in parallel,
    interleaved rotary positions on `rotary_dim` features of each head, no
    attention biases, an untied head with a bias."""
    return {"num_layers": num_layers, "hidden_dim": hidden_dim, "num_heads": num_heads,
            "intermediate_dim": 4 * hidden_dim, "positions": "rotary",
            "rotary_fraction": rotary_dim / (hidden_dim // num_heads),
            "rotary_interleaved": True, "attention_bias": False, "output_bias": False,
            "residual": "parallel", "tie_embeddings": False, "lm_head_bias": True, **fields}


PRESETS = {
    "gptj-demo": _gptj(4, 192, 4, 16, vocabulary_size=2000, max_sequence_length=128),
    "gptj-6b": _gptj(28, 4096, 16, 64, vocabulary_size=50400, max_sequence_length=2048),
}
