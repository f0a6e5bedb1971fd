"""GPT-2 checkpoints in the transformers layout: `config.json` both ways, the weights'
names, its adapters, and the directory with its tokenizer (`tfgpt.models.decoder_family`).

A GPT-2 checkpoint directory holds `config.json`, the weights
(`model.safetensors`, its sharded form with `model.safetensors.index.json`,
or `pytorch_model.bin`) and the byte-level BPE files `vocab.json` and
`merges.txt`. The two networks are the same: GPT-2's `Conv1D` weights are
(in, out) like Keras `Dense` kernels, and `c_attn` packs queries, keys and
values with the heads contiguous, which is tfgpt's `query_key_value` layout,
so every tensor copies over unchanged except the untied output projection
(PyTorch stores `lm_head.weight` as (out, in)). `python -m tfgpt.convert`
is the command line.
"""

import dataclasses
import json
import os

import numpy as np

from tfgpt.config import GPTConfig
from tfgpt.convert_decoders import AS_IS, JOINED, require_switches
from tfgpt.hf_files import read_weights
from tfgpt.models.adapters import save_peft
from tfgpt.models.gpt import GPT
from tfgpt.tokenizers import BytePairTokenizer, check_tokenizer_matches_model

_ACTIVATION_FROM_GPT2 = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
_ACTIVATION_TO_GPT2 = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
# Non-trainable buffers some GPT-2 checkpoints carry (the causal mask).
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def gpt_config_from_gpt2(gpt2_config):
    """Returns the GPTConfig of a GPT-2 `config.json` dict.

    GPT-2 has three dropout rates; tfgpt has one and takes `resid_pdrop`.
    """
    if gpt2_config.get("model_type") != "gpt2":
        raise ValueError(
            "Not a GPT-2 config. Received: "
            f"model_type={gpt2_config.get('model_type')!r}, expected 'gpt2'"
        )
    activation = gpt2_config.get("activation_function", "gelu_new")
    if activation not in _ACTIVATION_FROM_GPT2:
        raise ValueError(
            "Unsupported GPT-2 `activation_function`. Received: "
            f"activation_function={activation!r}, expected one of "
            f"{sorted(_ACTIVATION_FROM_GPT2)}"
        )
    for name, supported in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if gpt2_config.get(name, supported) != supported:
            raise ValueError(
                f"Unsupported GPT-2 option. Received: {name}={gpt2_config[name]!r}; "
                f"tfgpt's GPT implements {name}={supported}"
            )
    hidden_dim = gpt2_config["n_embd"]
    return GPTConfig(
        vocabulary_size=gpt2_config["vocab_size"],
        num_layers=gpt2_config["n_layer"],
        num_heads=gpt2_config["n_head"],
        hidden_dim=hidden_dim,
        intermediate_dim=gpt2_config.get("n_inner") or 4 * hidden_dim,
        max_sequence_length=gpt2_config["n_positions"],
        dropout=float(gpt2_config.get("resid_pdrop", 0.1)),
        activation=_ACTIVATION_FROM_GPT2[activation],
        norm_first=True,
        tie_embeddings=bool(gpt2_config.get("tie_word_embeddings", True)),
        layer_norm_epsilon=float(gpt2_config.get("layer_norm_epsilon", 1e-5)),
    )


def special_token_ids(tokenizer):
    """`(bos_id, eos_id)` of `tokenizer` for GPT-2's `config.json`.

    GPT-2's byte-level BPE uses `<|endoftext|>` for both; one read from a
    `tokenizer.json` that puts a token first (Llama 3) has that as bos. A SentencePiece
    tokenizer (`pipelines.tokenizer.Tokenizer`) has its own ids: tfgpt's
    runs train theirs with eos 2 and no bos (`bos_id` -1). An id the
    tokenizer lacks, or no tokenizer, is None.
    """
    if tokenizer is None:
        return None, None
    if isinstance(tokenizer, BytePairTokenizer):
        bos = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        return bos, tokenizer.eos_id
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    return (bos if bos >= 0 else None), (eos if eos >= 0 else None)


def gpt2_config_from_model(model, bos_id=None, eos_id=None):
    """Returns the GPT-2 `config.json` dict describing `model`.

    `bos_token_id` and `eos_token_id` are always written, as null when
    None: left out, `transformers.GPT2Config` would fill in GPT-2's 50256,
    which lies outside a smaller vocabulary.
    """
    for name, token_id in (("bos_id", bos_id), ("eos_id", eos_id)):
        if token_id is not None and not 0 <= token_id < model.vocabulary_size:
            raise ValueError(
                f"`{name}` must be an id of the model's vocabulary (0 to "
                f"{model.vocabulary_size - 1}). Received: {name}={token_id}"
            )
    if not model.norm_first:
        raise ValueError(
            "GPT-2 is a pre-layer-norm network; a post-layer-norm model has no "
            "GPT-2 equivalent. Received: norm_first=False"
        )
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocabulary_size,
        "n_positions": model.max_sequence_length,
        "n_embd": model.hidden_dim,
        "n_layer": model.num_layers,
        "n_head": model.num_heads,
        "n_inner": model.intermediate_dim,
        "activation_function": _ACTIVATION_TO_GPT2[model.activation],
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "layer_norm_epsilon": model.layer_norm_epsilon,
        "tie_word_embeddings": model.tie_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    return config


def gpt2_weight_map(model):
    """Yields `(gpt2_name, variable, transpose)` for every weight of `model`.

    Names are those of `GPT2LMHeadModel` without the `transformer.` prefix;
    `transpose` is True where PyTorch stores the matrix as (out, in).
    """
    yield "wte.weight", model.embeddings.token_embedding.embeddings, False
    yield "wpe.weight", model.embeddings.position_embedding.embeddings, False
    for index, block in enumerate(model.blocks):
        prefix = f"h.{index}."
        for gpt2_name, layer in (
            ("ln_1", block.attention_norm),
            ("ln_2", block.feedforward_norm),
        ):
            yield prefix + gpt2_name + ".weight", layer.gamma, False
            yield prefix + gpt2_name + ".bias", layer.beta, False
        for gpt2_name, layer in _projections(block):
            yield prefix + gpt2_name + ".weight", layer.kernel, False
            yield prefix + gpt2_name + ".bias", layer.bias, False
    yield "ln_f.weight", model.final_norm.gamma, False
    yield "ln_f.bias", model.final_norm.beta, False
    if not model.tie_embeddings:
        yield "lm_head.weight", model.lm_head.kernel, True


def _projections(block):
    """`(gpt2_name, layer)` of a block's four projections (GPT-2's Conv1D layers)."""
    return (("attn.c_attn", block.attention.query_key_value),
            ("attn.c_proj", block.attention.output_projection),
            ("mlp.c_fc", block.feedforward_intermediate),
            ("mlp.c_proj", block.feedforward_output))


def save_gpt2_adapter(model, directory, base_model_name_or_path=""):
    """Writes `model`'s adapters (`tfgpt.models.adapters`) as a PEFT LoRA
    adapter of the GPT-2 checkpoint `save_gpt2_checkpoint(model)` writes:
    `adapter_config.json` and `adapter_model.safetensors`, which
    `peft.PeftModel.from_pretrained` loads onto that checkpoint.

    PEFT keeps A as `lora_A.weight` (rank, in) and B as `lora_B.weight`
    (out, rank), the transposes of tfgpt's; GPT-2's Conv1D layers take
    `fan_in_fan_out`. Raises ValueError as `tfgpt.models.adapters.save_peft`.
    """
    modules = {f"transformer.h.{index}.{gpt2_name}": (layer, None)
               for index, block in enumerate(model.blocks)
               for gpt2_name, layer in _projections(block) if getattr(layer, "adapter_rank", 0)}
    save_peft(directory, modules, base_model_name_or_path, fan_in_fan_out=True)


def load_gpt2_checkpoint(directory, dtype=None, load_tokenizer=True):
    """Builds a tfgpt GPT from a Hugging Face GPT-2 checkpoint directory.

    Args:
        directory: str. Holds `config.json`, `model.safetensors` (or its
            sharded index, or `pytorch_model.bin`), `vocab.json` and
            `merges.txt`.
        dtype: optional Keras dtype policy for the model.
        load_tokenizer: bool. Read `vocab.json` and `merges.txt` (they must
            exist); when False the tokenizer returned is None.

    Returns:
        `(model, tokenizer)`: a GPT with the checkpoint's shape and weights
        and a `BytePairTokenizer`.

    Example:
    >>> model, tokenizer = load_gpt2_checkpoint("gpt2")  # doctest: +SKIP
    >>> model.generate([tokenizer.encode("Hello")], max_new_tokens=5)  # doctest: +SKIP
    """
    config_path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"GPT-2 checkpoint directory not found: {directory}")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"No config.json in the GPT-2 checkpoint: {config_path}")
    with open(config_path) as file:
        config = gpt_config_from_gpt2(json.load(file))
    tokenizer = BytePairTokenizer.from_directory(directory) if load_tokenizer else None
    model = GPT(**dataclasses.asdict(config), dtype=dtype)
    if tokenizer is not None:
        check_tokenizer_matches_model(tokenizer, model)
    weights = _read_weights(directory)
    _assign_weights(model, weights, source=directory)
    return model, tokenizer


def save_gpt2_checkpoint(model, directory, tokenizer=None):
    """Writes `model` as a Hugging Face GPT-2 checkpoint directory.

    Writes `config.json` (with the tokenizer's bos and eos ids,
    `special_token_ids`) and `model.safetensors` (float32, the tied output
    projection omitted as `save_pretrained` does) and, given a
    `BytePairTokenizer`, `vocab.json` and `merges.txt`. A SentencePiece
    tokenizer has no GPT-2 files: only its ids are written.
    """
    from safetensors.numpy import save_file

    bos_id, eos_id = special_token_ids(tokenizer)
    config = gpt2_config_from_model(model, bos_id=bos_id, eos_id=eos_id)
    os.makedirs(directory, exist_ok=True)
    tensors = {}
    for variable, names, layout in weight_map(model, "gpt2"):
        tensors.update(layout.to_torch(np.asarray(variable.numpy(), np.float32), names, model))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
    if isinstance(tokenizer, BytePairTokenizer):
        tokenizer.save(directory)


def _read_weights(directory):
    """The checkpoint's `CheckpointTensors` under names stripped of `transformer.`
    (without the attention-mask buffers some writers save)."""
    return read_weights(directory).renamed(
        lambda name: None if name.endswith(_BUFFER_SUFFIXES) else name.removeprefix("transformer."))


def _assign_weights(model, weights, source):
    expected = list(gpt2_weight_map(model))
    unused = set(weights) - {name for name, _, _ in expected}
    if model.tie_embeddings and "lm_head.weight" in weights:
        # Some writers store the tied projection anyway; it must equal wte.
        if not np.array_equal(weights["lm_head.weight"], weights.get("wte.weight")):
            raise ValueError(
                f"config.json in {source} says tie_word_embeddings=true but the "
                "weights hold an `lm_head.weight` different from `wte.weight`"
            )
        unused.discard("lm_head.weight")
    if unused:
        raise ValueError(
            f"The checkpoint in {source} has weights this GPT has no place for "
            f"(is config.json from the same model?). Received: "
            f"{', '.join(sorted(unused)[:5])}{' ...' if len(unused) > 5 else ''}"
        )
    for name, variable, transpose in expected:
        if name not in weights:
            raise ValueError(
                f"The checkpoint in {source} is missing the weight `{name}` that "
                "its config.json implies"
            )
        value = weights[name].T if transpose else weights[name]
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"Mismatched checkpoint shape for `{name}`: the weights file has "
                f"{tuple(weights[name].shape)}, config.json implies "
                f"{tuple(variable.shape[::-1]) if transpose else tuple(variable.shape)}. "
                f"Received: directory={source}"
            )
        variable.assign(value)


# ---- the family's conversion, as every decoder family's (`DecoderFamily`) --------------


def config_from_hf(hf_config, model_type, source):
    """The `GPTConfig` of a `gpt2` `config.json` dict (`gpt_config_from_gpt2`)."""
    return gpt_config_from_gpt2(hf_config)


def hf_config(config, model_type):
    """The `config.json` dict of a `GPTConfig` with GPT-2's switches, without
    token ids (`gpt2_config_from_model` writes a tokenizer's)."""
    require_switches(config, model_type, norm="layer", positions="learned", feedforward="dense",
                     residual="sequential", attention_bias=True, output_bias=True,
                     feedforward_bias=True, scale_attention=True, sliding_window=0,
                     lm_head_bias=False, num_key_value_heads=config.num_heads,
                     key_width=config.hidden_dim // config.num_heads)
    return gpt2_config_from_model(config)


def weight_map(model, model_type):
    """`(variable, hf_names, layout)` of every weight, under `GPT2LMHeadModel`'s names."""
    for name, variable, transpose in gpt2_weight_map(model):
        key = name if name.startswith("lm_head") else "transformer." + name
        yield variable, [key], JOINED if transpose else AS_IS


def load_checkpoint(directory, dtype=None):
    """`(model, tokenizer)` of a GPT-2 directory, for `tfgpt.loading.load_model`."""
    return load_gpt2_checkpoint(directory, dtype=dtype)


def save_adapter(model, directory, model_type, base_model_name_or_path=""):
    """`save_gpt2_adapter`, for `tfgpt.convert_decoders.save_hf_adapter`."""
    save_gpt2_adapter(model, directory, base_model_name_or_path)
