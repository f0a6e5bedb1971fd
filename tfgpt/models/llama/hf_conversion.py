"""Llama, Mistral and Qwen2 checkpoints in the transformers layout: `config.json`
both ways and the names of the weights (`tfgpt.models.decoder_family`)."""

from tfgpt.config import GPTConfig
from tfgpt.convert_decoders import (
    ACTIVATION_NAMES,
    ARCHITECTURES,
    AS_IS,
    JOINED,
    activation_of,
    dense_weights,
    rope_fields,
)


def _sliding_window(hf_config, model_type, source):
    """The window every layer uses (0: none); mixed layers are refused."""
    window = hf_config.get("sliding_window") or 0
    if model_type == "llama" or not window:
        return 0
    if model_type == "mistral":
        return int(window)
    layers = hf_config.get("layer_types") or []
    windowed = {kind == "sliding_attention" for kind in layers}
    if not hf_config.get("use_sliding_window", False) or windowed == {False}:
        return 0
    if windowed == {True}:
        return int(window)
    raise ValueError(
        f"{source}: layer_types mixes sliding and full attention across layers; tfgpt's "
        "sliding_window applies to every layer")


def config_from_hf(hf_config, model_type, source):
    """The `GPTConfig` of a `llama`, `mistral` or `qwen2` `config.json` dict."""
    activation = activation_of(hf_config, "hidden_act", "silu", source)
    heads, hidden = hf_config["num_attention_heads"], hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    qwen2 = model_type == "qwen2"
    attention_bias = bool(hf_config.get("attention_bias", False))
    return GPTConfig(
        vocabulary_size=hf_config["vocab_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=hf_config["intermediate_size"],
        max_sequence_length=hf_config.get("max_position_embeddings", 2048),
        dropout=float(hf_config.get("attention_dropout", 0.0) or 0.0),
        activation=activation,
        norm_first=True,
        layer_norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        norm="rms",
        positions="rotary",
        num_key_value_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=0 if head_dim * heads == hidden else head_dim,
        attention_bias=qwen2 or attention_bias,
        output_bias=attention_bias and not qwen2,
        feedforward="gated",
        feedforward_bias=bool(hf_config.get("mlp_bias", False)),
        sliding_window=_sliding_window(hf_config, model_type, source),
        **rope_fields(hf_config, source),
    )


def hf_config(config, model_type):
    """The `config.json` dict (transformers 5 layout) of a `GPTConfig` with Llama's switches."""
    if (config.norm, config.positions, config.feedforward, config.residual) != (
            "rms", "rotary", "gated", "sequential") or config.rotary_interleaved or (
            config.rotary_fraction != 1.0):
        raise ValueError(
            f"A {model_type} checkpoint is an RMSNorm, full split-halves rotary, gated, "
            "sequential decoder. Received: norm={!r}, positions={!r}, feedforward={!r}, "
            "residual={!r}, rotary_interleaved={}, rotary_fraction={}".format(
                config.norm, config.positions, config.feedforward, config.residual,
                config.rotary_interleaved, config.rotary_fraction))
    rope = {"rope_type": {"none": "default"}.get(config.rope_scaling, config.rope_scaling),
            "rope_theta": config.rope_theta}
    if config.rope_scaling != "none":
        rope["factor"] = config.rope_factor
    if config.rope_scaling == "llama3":
        rope.update(low_freq_factor=config.rope_low_frequency_factor,
                    high_freq_factor=config.rope_high_frequency_factor,
                    original_max_position_embeddings=config.rope_original_max_length)
    fields = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocabulary_size,
        "hidden_size": config.hidden_dim,
        "intermediate_size": config.intermediate_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.key_value_heads,
        "head_dim": config.key_width,
        "hidden_act": ACTIVATION_NAMES[config.activation],
        "max_position_embeddings": config.max_sequence_length,
        "rms_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": rope,
        "attention_dropout": config.dropout,
        "torch_dtype": "float32",
    }
    if model_type == "qwen2":
        fields["use_sliding_window"] = bool(config.sliding_window)
    else:
        fields["attention_bias"] = config.attention_bias
        fields["mlp_bias"] = config.feedforward_bias
    if config.sliding_window:
        fields["sliding_window"] = config.sliding_window
    return fields


def weight_map(model, model_type):
    """`(variable, hf_names, layout)` of every weight, under `LlamaForCausalLM`'s names."""
    yield model.embeddings.token_embedding.embeddings, ["model.embed_tokens.weight"], AS_IS
    for index, block in enumerate(model.blocks):
        prefix = f"model.layers.{index}."
        attention, parts = block.attention, ("q_proj", "k_proj", "v_proj")
        yield block.attention_norm.gamma, [prefix + "input_layernorm.weight"], JOINED
        yield (block.feedforward_norm.gamma, [prefix + "post_attention_layernorm.weight"],
               JOINED)
        layers = ([(attention.query, parts[:1]), (attention.key_value, parts[1:])]
                  if attention.grouped else [(attention.query_key_value, parts)])
        layers.append((attention.output_projection, ("o_proj",)))
        for layer, names in layers:
            for attribute, suffix in (("kernel", "weight"), ("bias", "bias")):
                if getattr(layer, attribute, None) is not None:
                    yield getattr(layer, attribute), [f"{prefix}self_attn.{name}.{suffix}"
                                                      for name in names], JOINED
        yield from dense_weights(prefix + "mlp.", (
            (block.feedforward_gate, "gate_proj"), (block.feedforward_intermediate, "up_proj"),
            (block.feedforward_output, "down_proj")))
    yield model.final_norm.gamma, ["model.norm.weight"], JOINED
    if model.lm_head is not None:
        yield model.lm_head.kernel, ["lm_head.weight"], JOINED
