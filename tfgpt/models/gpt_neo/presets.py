"""GPT-Neo presets: GPT-Neo's switches of GPTConfig at its published shapes and a demo size."""


def _neo(num_layers, hidden_dim, num_heads, **fields):
    """GPT-2's blocks, unscaled scores, local attention (256) every second layer."""
    return {"num_layers": num_layers, "hidden_dim": hidden_dim, "num_heads": num_heads,
            "intermediate_dim": 4 * hidden_dim, "max_sequence_length": 2048,
            "attention_bias": False, "scale_attention": False, "sliding_window": 256,
            "window_layers": "odd", **fields}


PRESETS = {
    "gpt-neo-demo": _neo(4, 192, 4, vocabulary_size=2000, max_sequence_length=128,
                         sliding_window=32),
    "gpt-neo-125m": _neo(12, 768, 12),
    "gpt-neo-1.3b": _neo(24, 2048, 16),
    "gpt-neo-2.7b": _neo(32, 2560, 20),
}
