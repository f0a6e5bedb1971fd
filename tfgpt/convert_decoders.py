"""GPT-J, GPT-Neo, GPT-NeoX, Llama, Mistral and Qwen2 checkpoints in the transformers
layout, in and out of tfgpt's GPT.

All six are tfgpt's one decoder with switches (`tfgpt.config.GPTConfig`):
- Llama, Mistral, Qwen2: RMSNorm, rotary positions in the split-halves
  convention, grouped-query attention, a SwiGLU feed-forward network, no
  biases but Qwen2's on the queries, keys and values, Mistral's sliding
  window.
- GPT-J: one layer norm feeding attention and the feed-forward network in
  parallel, rotary positions on the first `rotary_dim` features of each
  head turned in adjacent pairs, no attention biases, an untied head with
  a bias.
- GPT-Neo: GPT-2's blocks with unscaled scores, no query/key/value biases,
  and local attention (a sliding window) in every second layer.
- GPT-NeoX (Pythia): two layer norms in parallel (or sequential when
  `use_parallel_residual` is false), split-halves rotary positions on a
  `partial_rotary_factor` of each head, biases everywhere, an untied head.

`load_hf_decoder` builds the GPT that `config.json` describes and copies
every tensor in; `save_hf_decoder` writes it back as `config.json` and
`model.safetensors`, which transformers loads. Nothing is downloaded.

Layout differences handled here:
- torch `Linear.weight` is (out, in); a Keras `Dense.kernel` is (in, out).
- tfgpt fuses queries, keys and values into `query_key_value` ([3, H, D]
  columns) when every query head has its own key-value head, else keeps
  `query` and fuses `key_value` ([2, KV, D] columns); transformers keeps
  `q_proj`, `k_proj`, `v_proj` apart, and GPT-NeoX fuses them per head
  ([H, 3, D] rows).
- transformers 5 folds `rope_theta`, `rope_scaling`, `rotary_pct` and
  `rotary_emb_base` into `rope_parameters`; both layouts are read, the
  newer one is written.

Example:
>>> model = load_hf_decoder("checkpoints/Llama-3.2-1B")  # doctest: +SKIP
>>> model.generate([[128000, 9906]], max_new_tokens=5)  # doctest: +SKIP
"""

import dataclasses
import json
import os

import numpy as np

from tfgpt.config import GPTConfig
from tfgpt.hf_files import read_hf_checkpoint
from tfgpt.models.adapters import adapted_layers, save_peft
from tfgpt.models.gpt import GPT

# model_type -> the `architectures` entry transformers writes for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "gptj": "GPTJForCausalLM",
                 "gpt_neo": "GPTNeoForCausalLM", "gpt_neox": "GPTNeoXForCausalLM"}
LLAMA_TYPES = ("llama", "mistral", "qwen2")
# Tensors some writers keep that are not weights (masks, frequencies).
_BUFFERS = (".attn.bias", ".attn.masked_bias", "attention.bias", "attention.masked_bias",
            "rotary_emb.inv_freq")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu": "gelu", "relu": "relu"}
_ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def _rope(hf_config, source):
    """GPTConfig's `rope_*` fields from either key layout of `config.json`."""
    parameters = hf_config.get("rope_parameters")
    if parameters is None:  # transformers 4: rope_theta beside an optional rope_scaling
        parameters = dict(hf_config.get("rope_scaling") or {})
        parameters.setdefault("rope_theta", hf_config.get(
            "rope_theta", hf_config.get("rotary_emb_base", 10000.0)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{source}: the rope scaling type {rope_type!r} is not one tfgpt computes "
            f"(it does {', '.join(sorted(_ROPE_TYPES))})")
    fields = {"rope_theta": float(parameters.get("rope_theta", 10000.0)),
              "rope_scaling": _ROPE_TYPES[rope_type]}
    if rope_type != "default":
        fields["rope_factor"] = float(parameters["factor"])
    if rope_type == "llama3":
        fields.update(
            rope_low_frequency_factor=float(parameters["low_freq_factor"]),
            rope_high_frequency_factor=float(parameters["high_freq_factor"]),
            rope_original_max_length=int(parameters["original_max_position_embeddings"]),
        )
    return fields


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


def _activation(hf_config, key, default, source):
    activation = hf_config.get(key, default)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{source}: {key} {activation!r} is not one tfgpt computes "
                         f"(it does {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[activation]


def hf_decoder_config(hf_config, source="config.json"):
    """The `GPTConfig` of a GPT-J, GPT-NeoX, Llama, Mistral or Qwen2 `config.json` dict."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not a decoder tfgpt reads; it reads "
            f"gpt2, {', '.join(ARCHITECTURES)}")
    if model_type == "gptj":
        return _gptj_config(hf_config, source)
    if model_type == "gpt_neox":
        return _neox_config(hf_config, source)
    if model_type == "gpt_neo":
        return _neo_config(hf_config, source)
    activation = _activation(hf_config, "hidden_act", "silu", source)
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
        **_rope(hf_config, source),
    )


def _gptj_config(hf_config, source):
    hidden, heads = hf_config["n_embd"], hf_config["n_head"]
    rotary_dim = hf_config.get("rotary_dim") or hidden // heads
    return GPTConfig(
        vocabulary_size=hf_config["vocab_size"], num_layers=hf_config["n_layer"],
        num_heads=heads, hidden_dim=hidden,
        intermediate_dim=hf_config.get("n_inner") or 4 * hidden,
        max_sequence_length=hf_config.get("n_positions", 2048),
        dropout=float(hf_config.get("resid_pdrop", 0.0) or 0.0),
        activation=_activation(hf_config, "activation_function", "gelu_new", source),
        layer_norm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        positions="rotary", rotary_fraction=rotary_dim / (hidden // heads),
        rotary_interleaved=True, attention_bias=False, output_bias=False,
        residual="parallel", lm_head_bias=not hf_config.get("tie_word_embeddings", False),
        **_rope(hf_config, source),
    )


def _neo_config(hf_config, source):
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
        activation=_activation(hf_config, "activation_function", "gelu_new", source),
        layer_norm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", True)),
        attention_bias=False, scale_attention=False,
        sliding_window=int(hf_config.get("window_size", 256)) if windowed else 0,
        window_layers=window_layers,
    )


def _neox_config(hf_config, source):
    parameters = hf_config.get("rope_parameters") or {}
    fraction = parameters.get("partial_rotary_factor", hf_config.get("rotary_pct", 0.25))
    bias = bool(hf_config.get("attention_bias", True))
    return GPTConfig(
        vocabulary_size=hf_config["vocab_size"], num_layers=hf_config["num_hidden_layers"],
        num_heads=hf_config["num_attention_heads"], hidden_dim=hf_config["hidden_size"],
        intermediate_dim=hf_config["intermediate_size"],
        max_sequence_length=hf_config.get("max_position_embeddings", 2048),
        dropout=float(hf_config.get("hidden_dropout", 0.0) or 0.0),
        activation=_activation(hf_config, "hidden_act", "gelu", source),
        layer_norm_epsilon=float(hf_config.get("layer_norm_eps", 1e-5)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        positions="rotary", rotary_fraction=float(fraction), attention_bias=bias,
        output_bias=bias,
        residual=("parallel_two_norms" if hf_config.get("use_parallel_residual", True)
                  else "sequential"),
        **_rope(hf_config, source),
    )


def hf_config_of(config, model_type="llama"):
    """The `config.json` dict (transformers 5 layout) of a `GPTConfig` with Llama's switches."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"`model_type` must be one of {tuple(ARCHITECTURES)}. "
                         f"Received: model_type={model_type!r}")
    if model_type == "gptj":
        return _gptj_hf_config(config)
    if model_type == "gpt_neox":
        return _neox_hf_config(config)
    if model_type == "gpt_neo":
        return _neo_hf_config(config)
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
    hf_config = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocabulary_size,
        "hidden_size": config.hidden_dim,
        "intermediate_size": config.intermediate_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.key_value_heads,
        "head_dim": config.key_width,
        "hidden_act": _ACTIVATION_NAMES[config.activation],
        "max_position_embeddings": config.max_sequence_length,
        "rms_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": rope,
        "attention_dropout": config.dropout,
        "torch_dtype": "float32",
    }
    if model_type == "qwen2":
        hf_config["use_sliding_window"] = bool(config.sliding_window)
    else:
        hf_config["attention_bias"] = config.attention_bias
        hf_config["mlp_bias"] = config.feedforward_bias
    if config.sliding_window:
        hf_config["sliding_window"] = config.sliding_window
    return hf_config


def _gptj_hf_config(config):
    _require(config, "gptj", norm="layer", positions="rotary", rotary_interleaved=True,
             feedforward="dense", residual="parallel", attention_bias=False,
             output_bias=False, feedforward_bias=True, num_key_value_heads=config.num_heads,
             lm_head_bias=not config.tie_embeddings)
    return {
        "architectures": [ARCHITECTURES["gptj"]], "model_type": "gptj",
        "vocab_size": config.vocabulary_size, "n_positions": config.max_sequence_length,
        "n_embd": config.hidden_dim, "n_layer": config.num_layers, "n_head": config.num_heads,
        "rotary_dim": config.rotary_dim, "n_inner": config.intermediate_dim,
        "activation_function": _ACTIVATION_NAMES[config.activation],
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout, "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings, "torch_dtype": "float32",
    }


def _neo_hf_config(config):
    _require(config, "gpt_neo", norm="layer", positions="learned", feedforward="dense",
             residual="sequential", attention_bias=False, output_bias=True,
             feedforward_bias=True, scale_attention=False, lm_head_bias=False,
             num_key_value_heads=config.num_heads)
    kinds = (["global", "local"] if config.window_layers == "odd" and config.sliding_window
             else ["local" if config.sliding_window else "global"] * 2)
    if config.num_layers % 2:
        raise ValueError("GPT-Neo's attention_types repeat pairs of layers: num_layers must "
                         f"be even. Received: num_layers={config.num_layers}")
    return {
        "architectures": [ARCHITECTURES["gpt_neo"]], "model_type": "gpt_neo",
        "vocab_size": config.vocabulary_size, "hidden_size": config.hidden_dim,
        "num_layers": config.num_layers, "num_heads": config.num_heads,
        "intermediate_size": config.intermediate_dim,
        "attention_types": [[kinds, config.num_layers // 2]],
        "window_size": config.sliding_window or 256,
        "activation_function": _ACTIVATION_NAMES[config.activation],
        "max_position_embeddings": config.max_sequence_length,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_embeddings,
        "resid_dropout": config.dropout, "embed_dropout": config.dropout,
        "attention_dropout": config.dropout, "torch_dtype": "float32",
    }


def _neox_hf_config(config):
    _require(config, "gpt_neox", norm="layer", positions="rotary", rotary_interleaved=False,
             feedforward="dense", feedforward_bias=True, attention_bias=config.output_bias,
             num_key_value_heads=config.num_heads, lm_head_bias=False)
    if config.residual == "parallel":
        raise ValueError("GPT-NeoX's parallel residual has two norms: "
                         "residual='parallel_two_norms' or 'sequential'. Received: 'parallel'")
    return {
        "architectures": [ARCHITECTURES["gpt_neox"]], "model_type": "gpt_neox",
        "vocab_size": config.vocabulary_size, "hidden_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_dim,
        "hidden_act": _ACTIVATION_NAMES[config.activation],
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


def _require(config, model_type, **wanted):
    """Raises naming the first switch of `config` that `model_type` lacks."""
    for name, value in wanted.items():
        got = config.key_value_heads if name == "num_key_value_heads" else getattr(config, name)
        if got != value:
            raise ValueError(f"A {model_type} checkpoint has {name}={value!r}; this model "
                             f"has {name}={got!r}")


def weight_map(model, model_type="llama"):
    """Yields `(variable, hf_names, layout)` for every weight of `model`.

    `hf_names` are the transformers tensors the variable holds, joined
    along the Keras kernel's output axis (a torch weight transposed); a
    1-D weight (norm, bias) joins along its only axis. `layout` is
    `"neox"` for GPT-NeoX's per-head fused query, key and value, `"table"`
    for an embedding table (the same (rows, width) in both), else `"joined"`.
    """
    if model_type == "gptj":
        yield from _gptj_weights(model)
        return
    if model_type == "gpt_neox":
        yield from _neox_weights(model)
        return
    if model_type == "gpt_neo":
        yield from _neo_weights(model)
        return
    yield model.embeddings.token_embedding.embeddings, ["model.embed_tokens.weight"], "table"
    for index, block in enumerate(model.blocks):
        prefix = f"model.layers.{index}."
        attention, parts = block.attention, ("q_proj", "k_proj", "v_proj")
        yield block.attention_norm.gamma, [prefix + "input_layernorm.weight"], "joined"
        yield (block.feedforward_norm.gamma, [prefix + "post_attention_layernorm.weight"],
               "joined")
        layers = ([(attention.query, parts[:1]), (attention.key_value, parts[1:])]
                  if attention.grouped else [(attention.query_key_value, parts)])
        layers.append((attention.output_projection, ("o_proj",)))
        for layer, names in layers:
            for attribute, suffix in (("kernel", "weight"), ("bias", "bias")):
                if getattr(layer, attribute, None) is not None:
                    yield getattr(layer, attribute), [f"{prefix}self_attn.{name}.{suffix}"
                                                      for name in names], "joined"
        yield from _dense_weights(prefix + "mlp.", (
            (block.feedforward_gate, "gate_proj"), (block.feedforward_intermediate, "up_proj"),
            (block.feedforward_output, "down_proj")))
    yield model.final_norm.gamma, ["model.norm.weight"], "joined"
    if model.lm_head is not None:
        yield model.lm_head.kernel, ["lm_head.weight"], "joined"


def _dense_weights(prefix, layers):
    for layer, name in layers:
        yield layer.kernel, [f"{prefix}{name}.weight"], "joined"
        if layer.bias is not None:
            yield layer.bias, [f"{prefix}{name}.bias"], "joined"


def _norm_weights(name, norm):
    yield norm.gamma, [name + ".weight"], "joined"
    yield norm.beta, [name + ".bias"], "joined"


def _gptj_weights(model):
    yield model.embeddings.token_embedding.embeddings, ["transformer.wte.weight"], "table"
    for index, block in enumerate(model.blocks):
        prefix = f"transformer.h.{index}."
        yield from _norm_weights(prefix + "ln_1", block.attention_norm)
        yield (block.attention.query_key_value.kernel,
               [prefix + f"attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj")],
               "joined")
        yield block.attention.output_projection.kernel, [prefix + "attn.out_proj.weight"], "joined"
        yield from _dense_weights(prefix + "mlp.", ((block.feedforward_intermediate, "fc_in"),
                                                    (block.feedforward_output, "fc_out")))
    yield from _norm_weights("transformer.ln_f", model.final_norm)
    if model.lm_head is not None:
        yield from _dense_weights("", ((model.lm_head, "lm_head"),))


def _neo_weights(model):
    yield model.embeddings.token_embedding.embeddings, ["transformer.wte.weight"], "table"
    yield model.embeddings.position_embedding.embeddings, ["transformer.wpe.weight"], "table"
    for index, block in enumerate(model.blocks):
        prefix = f"transformer.h.{index}."
        yield from _norm_weights(prefix + "ln_1", block.attention_norm)
        yield from _norm_weights(prefix + "ln_2", block.feedforward_norm)
        yield (block.attention.query_key_value.kernel,
               [prefix + f"attn.attention.{name}.weight"
                for name in ("q_proj", "k_proj", "v_proj")], "joined")
        yield from _dense_weights(prefix, (
            (block.attention.output_projection, "attn.attention.out_proj"),
            (block.feedforward_intermediate, "mlp.c_fc"), (block.feedforward_output, "mlp.c_proj")))
    yield from _norm_weights("transformer.ln_f", model.final_norm)
    if model.lm_head is not None:
        yield model.lm_head.kernel, ["lm_head.weight"], "joined"


def _neox_weights(model):
    yield model.embeddings.token_embedding.embeddings, ["gpt_neox.embed_in.weight"], "table"
    for index, block in enumerate(model.blocks):
        prefix = f"gpt_neox.layers.{index}."
        yield from _norm_weights(prefix + "input_layernorm", block.attention_norm)
        yield from _norm_weights(prefix + "post_attention_layernorm", block.feedforward_norm)
        fused = block.attention.query_key_value
        yield fused.kernel, [prefix + "attention.query_key_value.weight"], "neox"
        if fused.bias is not None:
            yield fused.bias, [prefix + "attention.query_key_value.bias"], "neox"
        yield from _dense_weights(prefix, ((block.attention.output_projection, "attention.dense"),
                                           (block.feedforward_intermediate, "mlp.dense_h_to_4h"),
                                           (block.feedforward_output, "mlp.dense_4h_to_h")))
    yield from _norm_weights("gpt_neox.final_layer_norm", model.final_norm)
    if model.lm_head is not None:
        yield model.lm_head.kernel, ["embed_out.weight"], "joined"


def _neox_to_keras(value, heads):
    """GPT-NeoX's fused query/key/value, rows [H, 3, D] (weight (3HD, C) or bias
    (3HD,)), as tfgpt's columns [3, H, D] (kernel (C, 3HD) or bias)."""
    rest = value.shape[1:]
    value = value.reshape((heads, 3, -1) + rest).swapaxes(0, 1).reshape((-1,) + rest)
    return value.T if value.ndim == 2 else value


def _keras_to_neox(value, heads):
    value = value.T if value.ndim == 2 else value
    rest = value.shape[1:]
    return value.reshape((3, heads, -1) + rest).swapaxes(0, 1).reshape((-1,) + rest)


def _joined(tensors, names, layout, model):
    """The Keras value of `names`: torch matrices transposed and joined column-wise."""
    if layout == "neox":
        return _neox_to_keras(tensors[names[0]], model.num_heads)
    if layout == "table":
        return tensors[names[0]]
    parts = [tensors[name] for name in names]
    if parts[0].ndim == 2:
        parts = [part.T for part in parts]
    return np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def load_hf_weights(model, tensors, source, model_type="llama"):
    """Copies transformers `tensors` into `model`, checking names and shapes."""
    expected = list(weight_map(model, model_type))
    wanted = {name for _, names, _ in expected for name in names}
    # A tied head some writers store anyway.
    tied = {"lm_head.weight", "embed_out.weight"} if model.config.tie_embeddings else set()
    unused = {name for name in set(tensors) - wanted - tied if not name.endswith(_BUFFERS)}
    if unused:
        raise ValueError(
            f"The checkpoint in {source} has tensors this model has no place for (is "
            f"config.json from the same model?). Received: {', '.join(sorted(unused)[:5])}"
            f"{' ...' if len(unused) > 5 else ''}")
    for variable, names, layout in expected:
        missing = [name for name in names if name not in tensors]
        if missing:
            raise ValueError(f"The checkpoint in {source} lacks `{missing[0]}`, which its "
                             "config.json implies")
        value = _joined(tensors, names, layout, model)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"The checkpoint in {source} disagrees with its config.json: `{names[0]}` "
                f"gives {tuple(value.shape)} where the config implies {tuple(variable.shape)}")
        variable.assign(value.astype(np.float32))


def load_hf_decoder(directory, dtype=None):
    """A GPT with the weights of a GPT-J, GPT-NeoX, Llama, Mistral or Qwen2 checkpoint directory.

    Args:
        directory: str. `config.json` and its weights (`model.safetensors`,
            `pytorch_model.bin` or their shards, `tfgpt.hf_files`), as
            transformers' `save_pretrained` writes them.
        dtype: optional Keras dtype policy.
    """
    hf_config, tensors = read_hf_checkpoint(directory)
    config = hf_decoder_config(hf_config, source=os.path.join(directory, "config.json"))
    model = GPT(**dataclasses.asdict(config), dtype=dtype)
    load_hf_weights(model, tensors, directory, hf_config["model_type"])
    return model


def save_hf_decoder(model, directory, model_type="llama"):
    """Writes `model` as a transformers `model_type` checkpoint: `config.json`
    and `model.safetensors` (float32; a tied head is not written)."""
    from safetensors.numpy import save_file

    hf_config = hf_config_of(model.config, model_type)
    tensors = {}
    for variable, names, layout in weight_map(model, model_type):
        tensors.update(_torch_parts(model, np.asarray(variable.numpy(), np.float32), names,
                                    layout))
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(hf_config, file, indent=2, sort_keys=True)
        file.write("\n")


def _torch_parts(model, value, names, layout):
    """`{name: array}` of the transformers tensors `names` that the Keras `value`
    holds (`weight_map`): matrices transposed, a fused projection cut into its parts."""
    if layout in ("neox", "table"):
        return {names[0]: np.ascontiguousarray(
            _keras_to_neox(value, model.num_heads) if layout == "neox" else value)}
    sizes = [0]
    if len(names) > 1:  # the fused projection's parts, in order
        kv = model.config.key_value_heads * model.config.key_width
        widths = {"q_proj": model.config.num_heads * model.config.key_width}
        sizes = np.cumsum([widths.get(name.split(".")[-2], kv) for name in names])[:-1]
    parts = np.split(value, sizes, axis=-1) if len(names) > 1 else [value]
    return {name: np.ascontiguousarray(part.T if part.ndim == 2 else part)
            for name, part in zip(names, parts)}


def save_hf_adapter(model, directory, model_type="llama", base_model_name_or_path=""):
    """Writes `model`'s adapters (`tfgpt.models.adapters`) as a PEFT LoRA adapter
    of the `model_type` checkpoint `save_hf_decoder` writes (`adapter_config.json`,
    `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` loads.

    A fused projection's adapter becomes one adapter per transformers
    projection: the same A (`lora_A.weight`, (rank, in)) and B's columns of
    that projection (`lora_B.weight`, (out, rank)), which gives the same
    product. Raises ValueError as `tfgpt.models.adapters.save_peft`.
    """
    adapted = {id(layer.base_kernel): layer for layer in adapted_layers(model)}
    modules = {}
    for variable, names, layout in weight_map(model, model_type):
        layer = adapted.get(id(variable))
        if layer is not None:
            b = _torch_parts(model, np.asarray(layer.adapter_b.numpy(), np.float32), names, layout)
            modules.update({name[:-len(".weight")]: (layer, b[name]) for name in names})
    save_peft(directory, modules, base_model_name_or_path)
