"""GPT-J checkpoints in the transformers layout: `config.json` both ways and the
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
    rope_fields,
)


def config_from_hf(hf_config, model_type, source):
    """The `GPTConfig` of a `gptj` `config.json` dict."""
    hidden, heads = hf_config["n_embd"], hf_config["n_head"]
    rotary_dim = hf_config.get("rotary_dim") or hidden // heads
    return GPTConfig(
        vocabulary_size=hf_config["vocab_size"], num_layers=hf_config["n_layer"],
        num_heads=heads, hidden_dim=hidden,
        intermediate_dim=hf_config.get("n_inner") or 4 * hidden,
        max_sequence_length=hf_config.get("n_positions", 2048),
        dropout=float(hf_config.get("resid_pdrop", 0.0) or 0.0),
        activation=activation_of(hf_config, "activation_function", "gelu_new", source),
        layer_norm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        positions="rotary", rotary_fraction=rotary_dim / (hidden // heads),
        rotary_interleaved=True, attention_bias=False, output_bias=False,
        residual="parallel", lm_head_bias=not hf_config.get("tie_word_embeddings", False),
        **rope_fields(hf_config, source),
    )


def hf_config(config, model_type):
    """The `config.json` dict of a `GPTConfig` with GPT-J's switches."""
    require_switches(config, model_type, norm="layer", positions="rotary",
                     rotary_interleaved=True, feedforward="dense", residual="parallel",
                     attention_bias=False, output_bias=False, feedforward_bias=True,
                     num_key_value_heads=config.num_heads,
                     lm_head_bias=not config.tie_embeddings)
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": config.vocabulary_size, "n_positions": config.max_sequence_length,
        "n_embd": config.hidden_dim, "n_layer": config.num_layers, "n_head": config.num_heads,
        "rotary_dim": config.rotary_dim, "n_inner": config.intermediate_dim,
        "activation_function": ACTIVATION_NAMES[config.activation],
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout, "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings, "torch_dtype": "float32",
    }


def weight_map(model, model_type):
    """`(variable, hf_names, layout)` of every weight, under `GPTJForCausalLM`'s names."""
    yield model.embeddings.token_embedding.embeddings, ["transformer.wte.weight"], AS_IS
    for index, block in enumerate(model.blocks):
        prefix = f"transformer.h.{index}."
        yield from norm_weights(prefix + "ln_1", block.attention_norm)
        yield (block.attention.query_key_value.kernel,
               [prefix + f"attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj")],
               JOINED)
        yield block.attention.output_projection.kernel, [prefix + "attn.out_proj.weight"], JOINED
        yield from dense_weights(prefix + "mlp.", ((block.feedforward_intermediate, "fc_in"),
                                                   (block.feedforward_output, "fc_out")))
    yield from norm_weights("transformer.ln_f", model.final_norm)
    if model.lm_head is not None:
        yield from dense_weights("", ((model.lm_head, "lm_head"),))
