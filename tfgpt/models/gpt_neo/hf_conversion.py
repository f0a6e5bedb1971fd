"""GPT-Neo checkpoints in the transformers layout: `config.json` both ways and the
names of the weights (`tfgpt.models.decoder_family`)."""

from tfgpt.config import GPTConfig
from tfgpt.convert_decoders import (
    ACTIVATION_NAMES,
    ARCHITECTURES,
    AS_IS,
    JOINED,
    activation_of,
    dense_weights,
    norm_weights,
    require_switches,
)


def config_from_hf(hf_config, model_type, source):
    """The `GPTConfig` of a `gpt_neo` `config.json` dict."""
    layers = hf_config.get("attention_layers") or [
        kind for kinds, repeat in hf_config.get("attention_types", [[["global", "local"], 12]])
        for _ in range(repeat) for kind in kinds]
    patterns = {("global",) * len(layers): ("all", 0), ("local",) * len(layers): ("all", 1),
                tuple(["global", "local"] * (len(layers) // 2)): ("odd", 1)}
    if tuple(layers) not in patterns:
        raise ValueError(f"{source}: attention_layers {layers} is not all global, all local "
                         "or global and local alternating from global, which tfgpt computes")
    window_layers, windowed = patterns[tuple(layers)]
    hidden = hf_config["hidden_size"]
    return GPTConfig(
        vocabulary_size=hf_config["vocab_size"], num_layers=hf_config["num_layers"],
        num_heads=hf_config["num_heads"], hidden_dim=hidden,
        intermediate_dim=hf_config.get("intermediate_size") or 4 * hidden,
        max_sequence_length=hf_config.get("max_position_embeddings", 2048),
        dropout=float(hf_config.get("resid_dropout", 0.0) or 0.0),
        activation=activation_of(hf_config, "activation_function", "gelu_new", source),
        layer_norm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", True)),
        attention_bias=False, scale_attention=False,
        sliding_window=int(hf_config.get("window_size", 256)) if windowed else 0,
        window_layers=window_layers,
    )


def hf_config(config, model_type):
    """The `config.json` dict of a `GPTConfig` with GPT-Neo's switches."""
    require_switches(config, model_type, norm="layer", positions="learned", feedforward="dense",
                     residual="sequential", attention_bias=False, output_bias=True,
                     feedforward_bias=True, scale_attention=False, lm_head_bias=False,
                     num_key_value_heads=config.num_heads)
    kinds = (["global", "local"] if config.window_layers == "odd" and config.sliding_window
             else ["local" if config.sliding_window else "global"] * 2)
    if config.num_layers % 2:
        raise ValueError("GPT-Neo's attention_types repeat pairs of layers: num_layers must "
                         f"be even. Received: num_layers={config.num_layers}")
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": config.vocabulary_size, "hidden_size": config.hidden_dim,
        "num_layers": config.num_layers, "num_heads": config.num_heads,
        "intermediate_size": config.intermediate_dim,
        "attention_types": [[kinds, config.num_layers // 2]],
        "window_size": config.sliding_window or 256,
        "activation_function": ACTIVATION_NAMES[config.activation],
        "max_position_embeddings": config.max_sequence_length,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "resid_dropout": config.dropout, "embed_dropout": config.dropout,
        "attention_dropout": config.dropout, "torch_dtype": "float32",
    }


def weight_map(model, model_type):
    """`(variable, hf_names, layout)` of every weight, under `GPTNeoForCausalLM`'s names."""
    yield model.embeddings.token_embedding.embeddings, ["transformer.wte.weight"], AS_IS
    yield model.embeddings.position_embedding.embeddings, ["transformer.wpe.weight"], AS_IS
    for index, block in enumerate(model.blocks):
        prefix = f"transformer.h.{index}."
        yield from norm_weights(prefix + "ln_1", block.attention_norm)
        yield from norm_weights(prefix + "ln_2", block.feedforward_norm)
        yield (block.attention.query_key_value.kernel,
               [prefix + f"attn.attention.{name}.weight"
                for name in ("q_proj", "k_proj", "v_proj")], JOINED)
        yield from dense_weights(prefix, (
            (block.attention.output_projection, "attn.attention.out_proj"),
            (block.feedforward_intermediate, "mlp.c_fc"), (block.feedforward_output, "mlp.c_proj")))
    yield from norm_weights("transformer.ln_f", model.final_norm)
    if model.lm_head is not None:
        yield model.lm_head.kernel, ["lm_head.weight"], JOINED
