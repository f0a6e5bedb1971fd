"""GPT-NeoX presets: Pythia's switches of GPTConfig at its published shapes and a demo size."""


def _pythia(num_layers, hidden_dim, num_heads, vocabulary_size=50304, **fields):
    """Two norms in parallel, rotary positions on a quarter of each head, exact
    GELU, an untied head."""
    return {"num_layers": num_layers, "hidden_dim": hidden_dim, "num_heads": num_heads,
            "intermediate_dim": 4 * hidden_dim, "vocabulary_size": vocabulary_size,
            "max_sequence_length": 2048, "activation": "gelu", "positions": "rotary",
            "rotary_fraction": 0.25, "residual": "parallel_two_norms", "tie_embeddings": False,
            **fields}


PRESETS = {
    "pythia-demo": _pythia(4, 192, 4, vocabulary_size=2000, max_sequence_length=128),
    "pythia-70m": _pythia(6, 512, 8),
    "pythia-160m": _pythia(12, 768, 12),
    "pythia-410m": _pythia(24, 1024, 16),
    "pythia-1b": _pythia(16, 2048, 8),
    "pythia-1.4b": _pythia(24, 2048, 16),
    "pythia-2.8b": _pythia(32, 2560, 32),
    "pythia-6.9b": _pythia(32, 4096, 32, vocabulary_size=50432),
    "pythia-12b": _pythia(36, 5120, 40, vocabulary_size=50688),
}
