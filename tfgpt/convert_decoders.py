"""Hugging Face decoder checkpoints in and out of tfgpt's GPT, for every decoder family.

Each decoder family is tfgpt's one GPT with its switches
(`tfgpt.config.GPTConfig`) and a folder of `tfgpt/models/`, listed in
`tfgpt.models.decoder_families`: GPT-2, Llama (with Mistral and Qwen2),
GPT-J, GPT-Neo and GPT-NeoX (Pythia). The folder's `hf_conversion.py`
translates its `config.json` both ways and names the transformers tensors
each weight holds (`DecoderFamily`); this module does the rest for all of
them, by the checkpoint's `model_type`:

`load_hf_decoder` builds the GPT that `config.json` describes and copies
every tensor in; `save_hf_decoder` writes it back as `config.json` and
`model.safetensors`, which transformers loads; `save_hf_adapter` writes its
adapters as PEFT's. Nothing is downloaded.

Layout differences (each weight's `Layout`):
- torch `Linear.weight` is (out, in); a Keras `Dense.kernel` is (in, out)
  (`JOINED`); GPT-2's `Conv1D` weights and embedding tables are alike in both
  (`AS_IS`).
- tfgpt fuses queries, keys and values into `query_key_value` ([3, H, D]
  columns) when every query head has its own key-value head, else keeps
  `query` and fuses `key_value` ([2, KV, D] columns); transformers keeps
  `q_proj`, `k_proj`, `v_proj` apart (`JOINED` joins them), and GPT-NeoX
  fuses them per head ([H, 3, D] rows, its folder's layout).
- transformers 5 folds `rope_theta`, `rope_scaling`, `rotary_pct` and
  `rotary_emb_base` into `rope_parameters`; both layouts are read
  (`rope_fields`), the newer one is written.

Example:
>>> model = load_hf_decoder("checkpoints/Llama-3.2-1B")  # doctest: +SKIP
>>> model.generate([[128000, 9906]], max_new_tokens=5)  # doctest: +SKIP
"""

import dataclasses
import json
import os

import numpy as np

from tfgpt.checkpoint.files import region
from tfgpt.hf_files import read_hf_checkpoint
from tfgpt.models.adapters import adapted_layers, save_peft
from tfgpt.models.decoder_families import DECODER_FAMILIES, MODEL_TYPES
from tfgpt.models.gpt import GPT

# model_type -> the `architectures` entry transformers writes for it, every family's.
ARCHITECTURES = {model_type: architecture for family in DECODER_FAMILIES.values()
                 for model_type, architecture in family.architectures.items()}
# Tensors some writers keep that are not weights (masks, frequencies).
_BUFFERS = (".attn.bias", ".attn.masked_bias", "attention.bias", "attention.masked_bias",
            "rotary_emb.inv_freq")
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu": "gelu", "relu": "relu"}
# tfgpt's activation -> the name config.json writes for it.
ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def converter(model_type, source=None):
    """The `hf_conversion` module of the family that reads `model_type` (`DecoderFamily`).

    Raises ValueError naming the model types tfgpt reads, after `source`
    (the `config.json` path) when given.
    """
    family = MODEL_TYPES.get(model_type)
    if family is None:
        if source is not None:
            raise ValueError(f"{source}: model_type {model_type!r} is not a decoder tfgpt "
                             f"reads; it reads {', '.join(ARCHITECTURES)}")
        raise ValueError(f"`model_type` must be one of {tuple(ARCHITECTURES)}. "
                         f"Received: model_type={model_type!r}")
    return family.converter()


# ---- what the families' conversions are written with ------------------------------------


def rope_fields(hf_config, source):
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


def activation_of(hf_config, key, default, source):
    """tfgpt's name of the activation `config.json` names under `key`, or ValueError."""
    activation = hf_config.get(key, default)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{source}: {key} {activation!r} is not one tfgpt computes "
                         f"(it does {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[activation]


def require_switches(config, model_type, **wanted):
    """Raises naming the first switch of `config` that `model_type` lacks."""
    for name, value in wanted.items():
        got = config.key_value_heads if name == "num_key_value_heads" else getattr(config, name)
        if got != value:
            raise ValueError(f"A {model_type} checkpoint has {name}={value!r}; this model "
                             f"has {name}={got!r}")


def dense_weights(prefix, layers):
    """`weight_map` entries of dense `layers` (`(layer, transformers name)`): kernel, bias."""
    for layer, name in layers:
        yield layer.kernel, [f"{prefix}{name}.weight"], JOINED
        if layer.bias is not None:
            yield layer.bias, [f"{prefix}{name}.bias"], JOINED


def norm_weights(name, norm):
    """`weight_map` entries of a layer norm named `name`: its weight and bias."""
    yield norm.gamma, [name + ".weight"], JOINED
    yield norm.beta, [name + ".bias"], JOINED



class Layout:
    """How the transformers tensors a weight holds (`weight_map`'s `hf_names`) make
    its Keras value, and back."""

    def to_keras(self, parts, model):
        """The Keras value of the arrays `parts` (one per name, in order)."""
        raise NotImplementedError

    def to_torch(self, value, names, model):
        """`{name: array}` of the transformers tensors `names` that the Keras `value` holds."""
        raise NotImplementedError


class Joined(Layout):
    """torch matrices (out, in) transposed to Keras kernels (in, out); the parts of a
    fused projection (`q_proj`, `k_proj`, `v_proj`) joined along its output axis,
    in order; a 1-D weight (norm, bias) joined along its only axis."""

    def to_keras(self, parts, model):
        if parts[0].ndim == 2:
            parts = [part.T for part in parts]
        return np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    def to_torch(self, value, names, model):
        sizes = [0]
        if len(names) > 1:  # the fused projection's parts, in order
            kv = model.config.key_value_heads * model.config.key_width
            widths = {"q_proj": model.config.num_heads * model.config.key_width}
            sizes = np.cumsum([widths.get(name.split(".")[-2], kv) for name in names])[:-1]
        parts = np.split(value, sizes, axis=-1) if len(names) > 1 else [value]
        return {name: np.ascontiguousarray(part.T if part.ndim == 2 else part)
                for name, part in zip(names, parts)}


class AsIs(Layout):
    """The same array in both: an embedding table (rows, width), GPT-2's Conv1D (in, out)."""

    def to_keras(self, parts, model):
        return parts[0]

    def to_torch(self, value, names, model):
        return {names[0]: np.ascontiguousarray(value)}


JOINED, AS_IS = Joined(), AsIs()


# ---- every family's checkpoints ----------------------------------------------------------


def hf_decoder_config(hf_config, source="config.json"):
    """The `GPTConfig` of a decoder's `config.json` dict (any family's `model_type`)."""
    model_type = hf_config.get("model_type")
    return converter(model_type, source).config_from_hf(hf_config, model_type, source)


def hf_config_of(config, model_type="llama"):
    """The `config.json` dict (transformers 5 layout) of a `GPTConfig` as a `model_type`
    checkpoint; a ValueError names a switch the `model_type` lacks."""
    return converter(model_type).hf_config(config, model_type)


def weight_map(model, model_type="llama"):
    """Yields `(variable, hf_names, layout)` for every weight of `model`.

    `hf_names` are the transformers tensors the variable holds, in the
    order `layout` (a `Layout`: `JOINED`, `AS_IS` or a family's own) joins
    them.
    """
    yield from converter(model_type).weight_map(model, model_type)


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
        value = layout.to_keras([tensors[name] for name in names], model)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"The checkpoint in {source} disagrees with its config.json: `{names[0]}` "
                f"gives {tuple(value.shape)} where the config implies {tuple(variable.shape)}")
        variable.assign(value.astype(np.float32))


def load_hf_decoder(directory, dtype=None):
    """A GPT with the weights of a transformers decoder checkpoint directory (any
    family's `model_type`: GPT-2, GPT-J, GPT-Neo, GPT-NeoX, Llama, Mistral, Qwen2).

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


class HFDecoderReader:
    """A transformers decoder directory read as a tfgpt checkpoint of the whole model.

    `--init HF_DIR` and an adapter run's base read it through
    `tfgpt.checkpoint.base.open_checkpoint`, with the interface of
    `tfgpt.checkpoint.files.Reader` they use (`entry`, `whole`, `part`,
    `close`): the model `load_hf_decoder` builds, float32, its weights keyed
    by variable path as a checkpoint keys them, so that every layout takes
    its slices of them. The model is held whole while the reader is open.

    Args:
        path: str. The transformers checkpoint directory.
    """

    def __init__(self, path):
        from tfgpt.checkpoint.state import model_entries

        self.path = path
        self.index = {}  # (a checkpoint's index: nothing of an adapter base)
        self._variables = {entry.key: entry.variable for entry in
                           model_entries(load_hf_decoder(path, dtype="float32"))}

    def entry(self, key, shape=None):
        """`{"dtype", "shape"}` of `key`; raises in one line if this model lacks it or
        has another shape."""
        variable = self._variables.get(key)
        if variable is None:
            raise ValueError(f"{self.path} holds no {key!r}: its model is another than this "
                             "run's")
        if shape is not None and tuple(shape) != tuple(variable.shape):
            raise ValueError(f"{self.path} holds {key!r} with shape {tuple(variable.shape)}; "
                             f"this model's is {tuple(shape)}: another model")
        return {"dtype": "float32", "shape": list(variable.shape)}

    def whole(self, key):
        """The global tensor `key`."""
        self.entry(key)
        return self._variables[key].numpy()

    def part(self, key, shape=None, split=None, tensor=None, rows=None):
        """The region of `key` a rank holds (as `Reader.part`)."""
        self.entry(key, shape)
        return region(self._variables[key].numpy(), split, tensor, rows)

    def close(self):
        self._variables = {}


def save_hf_decoder(model, directory, model_type="llama"):
    """Writes `model` as a transformers `model_type` checkpoint: `config.json`
    and `model.safetensors` (float32; a tied head is not written)."""
    from safetensors.numpy import save_file

    hf_config = hf_config_of(model.config, model_type)
    tensors = {}
    for variable, names, layout in weight_map(model, model_type):
        tensors.update(layout.to_torch(np.asarray(variable.numpy(), np.float32), names, model))
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(hf_config, file, indent=2, sort_keys=True)
        file.write("\n")


def save_hf_adapter(model, directory, model_type="llama", base_model_name_or_path=""):
    """Writes `model`'s adapters (`tfgpt.models.adapters`) as a PEFT LoRA adapter
    of the `model_type` checkpoint `save_hf_decoder` writes (`adapter_config.json`,
    `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained` loads.

    A fused projection's adapter becomes one adapter per transformers
    projection: the same A (`lora_A.weight`, (rank, in)) and B's columns of
    that projection (`lora_B.weight`, (out, rank)), which gives the same
    product. A family may write its own (GPT-2: one adapter per Conv1D,
    `fan_in_fan_out`). Raises ValueError as `tfgpt.models.adapters.save_peft`.
    """
    family_conversion = converter(model_type)
    if hasattr(family_conversion, "save_adapter"):
        family_conversion.save_adapter(model, directory, model_type, base_model_name_or_path)
        return
    adapted = {id(layer.base_kernel): layer for layer in adapted_layers(model)}
    modules = {}
    for variable, names, layout in weight_map(model, model_type):
        layer = adapted.get(id(variable))
        if layer is not None:
            b = layout.to_torch(np.asarray(layer.adapter_b.numpy(), np.float32), names, model)
            modules.update({name[:-len(".weight")]: (layer, b[name]) for name in names})
    save_peft(directory, modules, base_model_name_or_path)
