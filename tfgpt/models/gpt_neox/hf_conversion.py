"""GPT-NeoX (Pythia) checkpoints in the transformers layout: `config.json` both ways,
the names of the weights and the per-head fused query/key/value layout
(`tfgpt.models.decoder_family`)."""

import numpy as np

from tfgpt.config import GPTConfig
from tfgpt.convert_decoders import (
    ACTIVATION_NAMES,
    ARCHITECTURES,
    AS_IS,
    JOINED,
    Layout,
    activation_of,
    dense_weights,
    norm_weights,
    require_switches,
    rope_fields,
)


class PerHead(Layout):
    """GPT-NeoX's fused query/key/value, rows [H, 3, D] (weight (3HD, C) or bias
    (3HD,)), as tfgpt's columns [3, H, D] (kernel (C, 3HD) or bias)."""

    def to_keras(self, parts, model):
        value = parts[0]
        rest = value.shape[1:]
        value = value.reshape((model.num_heads, 3, -1) + rest).swapaxes(0, 1).reshape(
            (-1,) + rest)
        return value.T if value.ndim == 2 else value

    def to_torch(self, value, names, model):
        value = value.T if value.ndim == 2 else value
        rest = value.shape[1:]
        value = value.reshape((3, model.num_heads, -1) + rest).swapaxes(0, 1).reshape(
            (-1,) + rest)
        return {names[0]: np.ascontiguousarray(value)}


PER_HEAD = PerHead()


def config_from_hf(hf_config, model_type, source):
    """The `GPTConfig` of a `gpt_neox` `config.json` dict."""
    parameters = hf_config.get("rope_parameters") or {}
    fraction = parameters.get("partial_rotary_factor", hf_config.get("rotary_pct", 0.25))
    bias = bool(hf_config.get("attention_bias", True))
    return GPTConfig(
        vocabulary_size=hf_config["vocab_size"], num_layers=hf_config["num_hidden_layers"],
        num_heads=hf_config["num_attention_heads"], hidden_dim=hf_config["hidden_size"],
        intermediate_dim=hf_config["intermediate_size"],
        max_sequence_length=hf_config.get("max_position_embeddings", 2048),
        dropout=float(hf_config.get("hidden_dropout", 0.0) or 0.0),
        activation=activation_of(hf_config, "hidden_act", "gelu", source),
        layer_norm_epsilon=float(hf_config.get("layer_norm_eps", 1e-5)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        positions="rotary", rotary_fraction=float(fraction), attention_bias=bias,
        output_bias=bias,
        residual=("parallel_two_norms" if hf_config.get("use_parallel_residual", True)
                  else "sequential"),
        **rope_fields(hf_config, source),
    )


def hf_config(config, model_type):
    """The `config.json` dict of a `GPTConfig` with GPT-NeoX's switches."""
    require_switches(config, model_type, norm="layer", positions="rotary",
                     rotary_interleaved=False, feedforward="dense", feedforward_bias=True,
                     attention_bias=config.output_bias, num_key_value_heads=config.num_heads,
                     lm_head_bias=False)
    if config.residual == "parallel":
        raise ValueError("GPT-NeoX's parallel residual has two norms: "
                         "residual='parallel_two_norms' or 'sequential'. Received: 'parallel'")
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": config.vocabulary_size, "hidden_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_dim,
        "hidden_act": ACTIVATION_NAMES[config.activation],
        "max_position_embeddings": config.max_sequence_length,
        "layer_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "use_parallel_residual": config.residual == "parallel_two_norms",
        "attention_bias": config.attention_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.rotary_fraction},
        "hidden_dropout": config.dropout, "attention_dropout": config.dropout,
        "torch_dtype": "float32",
    }


def weight_map(model, model_type):
    """`(variable, hf_names, layout)` of every weight, under `GPTNeoXForCausalLM`'s names."""
    yield model.embeddings.token_embedding.embeddings, ["gpt_neox.embed_in.weight"], AS_IS
    for index, block in enumerate(model.blocks):
        prefix = f"gpt_neox.layers.{index}."
        yield from norm_weights(prefix + "input_layernorm", block.attention_norm)
        yield from norm_weights(prefix + "post_attention_layernorm", block.feedforward_norm)
        fused = block.attention.query_key_value
        yield fused.kernel, [prefix + "attention.query_key_value.weight"], PER_HEAD
        if fused.bias is not None:
            yield fused.bias, [prefix + "attention.query_key_value.bias"], PER_HEAD
        yield from dense_weights(prefix, ((block.attention.output_projection, "attention.dense"),
                                          (block.feedforward_intermediate, "mlp.dense_h_to_4h"),
                                          (block.feedforward_output, "mlp.dense_4h_to_h")))
    yield from norm_weights("gpt_neox.final_layer_norm", model.final_norm)
    if model.lm_head is not None:
        yield model.lm_head.kernel, ["embed_out.weight"], JOINED
