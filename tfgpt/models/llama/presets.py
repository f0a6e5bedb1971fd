"""Llama, Mistral and Qwen2 presets: Llama's switches of GPTConfig, and the published shapes."""

# RMSNorm, rotary positions, SwiGLU, no biases, an untied head; grouped-query
# attention comes with each shape's key-value heads. Mistral adds a sliding
# window, Qwen2 biases on the queries, keys and values.
SWITCHES = {"norm": "rms", "positions": "rotary", "feedforward": "gated", "activation": "silu",
            "attention_bias": False, "output_bias": False, "feedforward_bias": False,
            "tie_embeddings": False, "layer_norm_epsilon": 1e-5}


def _llama(num_layers, hidden_dim, num_heads, num_key_value_heads, intermediate_dim, **fields):
    """A shape with Llama's switches (`fields` override them)."""
    return {"num_layers": num_layers, "hidden_dim": hidden_dim, "num_heads": num_heads,
            "num_key_value_heads": num_key_value_heads, "intermediate_dim": intermediate_dim,
            **SWITCHES, **fields}


_LLAMA3 = dict(vocabulary_size=128256, max_sequence_length=131072, rope_theta=500000.0,
               rope_scaling="llama3", rope_low_frequency_factor=1.0,
               rope_high_frequency_factor=4.0, rope_original_max_length=8192)
_QWEN2 = dict(max_sequence_length=32768, rope_theta=1000000.0, layer_norm_epsilon=1e-6,
              attention_bias=True)
# The published shapes (their config.json as released); the parameter counts
# equal transformers' models of the same config (tests/test_hf_decoders.py).
PRESETS = {
    # Sized for a 2-core CPU, like gpt-demo: Llama's switches at gpt-demo's size.
    "llama-demo": _llama(4, 192, 4, 2, 512, vocabulary_size=2000, max_sequence_length=128),
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, tie_embeddings=True, rope_factor=32.0,
                          **_LLAMA3),
    "llama3.2-3b": _llama(28, 3072, 24, 8, 8192, tie_embeddings=True, rope_factor=32.0,
                          **_LLAMA3),
    "llama3.1-8b": _llama(32, 4096, 32, 8, 14336, rope_factor=8.0, **_LLAMA3),
    "mistral-demo": _llama(4, 192, 4, 2, 512, vocabulary_size=2000, max_sequence_length=128,
                           sliding_window=32),
    "qwen2-demo": _llama(4, 192, 4, 2, 512, vocabulary_size=2000, tie_embeddings=True,
                         **dict(_QWEN2, max_sequence_length=128)),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, vocabulary_size=32000,
                         max_sequence_length=32768, sliding_window=4096),
    "qwen2-0.5b": _llama(24, 896, 14, 2, 4864, vocabulary_size=151936, tie_embeddings=True,
                         **_QWEN2),
    "qwen2-1.5b": _llama(28, 1536, 12, 2, 8960, vocabulary_size=151936, tie_embeddings=True,
                         **_QWEN2),
    "qwen2-7b": _llama(28, 3584, 28, 4, 18944, vocabulary_size=152064, **_QWEN2),
}
