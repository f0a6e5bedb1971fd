"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's projections: add, merge.

`add_adapters(model, rank, alpha, dropout, targets)` freezes every weight of
`model` and gives each projection that `targets` names two trainable
matrices A (input width x rank) and B (rank x output width), B at zero:
the model's outputs are unchanged until training moves B
(`ActivatedDense.enable_adapter`). Only the adapters are then in
`model.trainable_variables`, so an optimizer built on them holds state for
them alone. `merged(model)` returns a new model without adapters whose
kernels hold `W + (alpha / rank) A B`: the same outputs, for
`tfgpt.export` or a Hugging Face directory.

Targets are the projections' layer names in tfgpt's blocks: the fused
`query_key_value` (or `query` and `key_value` under grouped-query
attention), `output_projection`, and the feed-forward layer's
`feedforward_gate` (gated MLPs), `feedforward_intermediate` and
`feedforward_output`. GPT-2's `c_attn`, `c_proj` and `c_fc` are
`query_key_value`, `output_projection` / `feedforward_output` and
`feedforward_intermediate`.

Example:
>>> model = GPT.from_preset("gpt-demo", vocabulary_size=300)
>>> adapted = add_adapters(model, rank=4, alpha=8)
>>> [v.path.rsplit("/", 2)[-2:] for v in model.trainable_variables][:2]
[['query_key_value', 'adapter_a'], ['query_key_value', 'adapter_b']]
"""

import json
import os

import keras
import numpy as np

from tfgpt.checkpoint.base import AdapterBase
from tfgpt.checkpoint.files import INDEX_FILE, Reader, latest
from tfgpt.checkpoint.run import load_parts, load_weights
from tfgpt.checkpoint.state import key_names, model_entries, relative_key
from tfgpt.layers.activated_dense import ActivatedDense

TARGETS = ("query_key_value", "query", "key_value", "output_projection", "feedforward_gate",
           "feedforward_intermediate", "feedforward_output")
DEFAULT_TARGETS = ("query_key_value", "query", "key_value", "output_projection")
# The fused attention input and its grouped-query form: targets may name both.
ALTERNATIVES = {"query_key_value": ("query", "key_value"), "query": ("query_key_value",),
                "key_value": ("query_key_value",)}


def _projections(model):
    """`[(name, layer)]` of the model's projections that can take an adapter, in model order."""
    return [(layer.name, layer) for layer in model.sublayers()
            if isinstance(layer, ActivatedDense) and layer.name in TARGETS]


def add_adapters(model, rank=8, alpha=16.0, dropout=0.0, targets=DEFAULT_TARGETS):
    """Freezes `model` and adds an adapter to each projection named in `targets`.

    Returns the adapted layers. Raises ValueError, in one line, for a target
    that names no projection of the model (the names it has are listed;
    `query_key_value` beside `query` and `key_value`, the fused and the
    grouped-query attention's input, asks for the model's form). A model
    built in tensor slices gets adapters split as their kernels are
    (`ActivatedDense.enable_adapter`).
    """
    projections = _projections(model)
    present = {name for name, _ in projections}
    unknown = [target for target in targets if target not in TARGETS]
    if unknown:
        raise ValueError(f"no projection is named {unknown[0]!r}: adapter targets are "
                         f"{', '.join(TARGETS)}; this model has {', '.join(sorted(present))}")
    # The attention's input is one fused projection or, under grouped-query
    # attention, two: targets that name both forms (the default, to fit both
    # kinds of model) take the model's.
    absent = [target for target in targets if target not in present
              and not present & set(targets) & set(ALTERNATIVES.get(target, ()))]
    if absent or not targets:
        raise ValueError(f"the adapter target {absent[0] if absent else ''!r} names no "
                         "projection of this model, which has "
                         f"{', '.join(sorted(present))}")
    for variable in model.variables:
        variable.trainable = False
    adapted = [layer for name, layer in projections if name in targets]
    for layer in adapted:
        layer.enable_adapter(rank, alpha, dropout)
    return adapted


def add_run_adapters(model, record):
    """Adds the adapters a run's `--lora-*` settings ask for (`record`: a
    `TrainConfig`'s fields, or the `train` record of its config.json), if any;
    returns the adapted layers."""
    if not record.get("lora_rank"):
        return []
    return add_adapters(model, rank=record["lora_rank"], alpha=record["lora_alpha"],
                        dropout=record["lora_dropout"],
                        targets=tuple(t for t in record["lora_targets"].split(",") if t))


def adapted_layers(model):
    """The projections of `model` that have an adapter, in model order."""
    return [layer for _, layer in _projections(model) if layer.adapter_rank]


def adapter_variables(model):
    """The adapters' A and B matrices of `model`, in model order."""
    ids = {id(v) for layer in adapted_layers(model) for v in (layer.adapter_a, layer.adapter_b)}
    return [v for v in model.variables if id(v) in ids]


def base_keys(model):
    """The checkpoint keys of `model`'s own weights: every one but its adapters'
    (and its dropouts' states), which an adapter run reads from its base."""
    adapters = {id(variable) for variable in adapter_variables(model)}
    return {entry.key for entry in model_entries(model) if id(entry.variable) not in adapters}


def load_adapters(directory, model):
    """Reads an adapter run's latest checkpoint into `model` (whole, with the
    run's adapters added): the adapters from it, the base weights from the
    base it names (`tfgpt.checkpoint.base`; a checkpoint that holds the
    whole model: from it). Returns the checkpoint's path."""
    path = latest(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint (ckpt-N/{INDEX_FILE}) in {directory}")
    reader = Reader(path)
    reference = reader.index.get("base")
    reader.close()
    if reference is None:
        return load_weights(directory, model)
    base = base_keys(model)
    entries = model_entries(model)
    AdapterBase(lambda: [e for e in entries if e.key in base], base).restore(reference, path)
    return load_parts(directory, [entry for entry in entries if entry.key not in base])


def merged(model):
    """A new model of `model`'s config without adapters, each adapted kernel
    holding `W + (alpha / rank) A B`; every other weight as in `model`."""
    plain = type(model).from_config(model.get_config())
    source = {entry.key: entry.variable for entry in model_entries(model)}
    names = key_names(model)
    deltas = {relative_key(layer.base_kernel, names): layer.adapter_delta()
              for layer in adapted_layers(model)}
    for entry in model_entries(plain):
        value = source[entry.key]
        if entry.key in deltas:
            value = value + keras.ops.cast(deltas[entry.key], value.dtype)
        entry.variable.assign(value)
    return plain


def save_peft(directory, modules, base_model_name_or_path="", **config):
    """Writes PEFT's LoRA layout: `modules` maps each transformers module name
    (`transformer.h.0.attn.c_attn`) to its adapter layer and, when a fused
    projection is cut into several, the torch-layout `(out, rank)` share of
    B (None: all of B). A becomes `lora_A.weight` (rank, in), B `lora_B.weight`
    (out, rank). `config` adds to `adapter_config.json` (`fan_in_fan_out`).

    Raises ValueError when there is no adapter, or adapters of several ranks,
    alphas or dropouts (one PEFT config holds one of each).
    """
    from safetensors.numpy import save_file

    if not modules:
        raise ValueError("the model has no adapters to save (tfgpt.models.adapters.add_adapters)")
    tensors, settings = {}, set()
    for module, (layer, b) in modules.items():
        a = np.asarray(layer.adapter_a.numpy(), np.float32).T
        b = np.asarray(layer.adapter_b.numpy(), np.float32).T if b is None else b
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b)
        settings.add((layer.adapter_rank, layer.adapter_scale * layer.adapter_rank,
                      layer.adapter_dropout.rate))
    if len(settings) > 1:
        raise ValueError("one PEFT adapter has one rank, alpha and dropout; these adapters have "
                         f"{sorted(settings)} (rank, alpha, dropout)")
    rank, alpha, dropout = settings.pop()
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    # Whole module names: PEFT matches a name equal to, or ending in "." and, a target.
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "lora_dropout": dropout, "target_modules": sorted(modules), "bias": "none",
              "base_model_name_or_path": base_model_name_or_path, "inference_mode": True,
              **config}
    with open(os.path.join(directory, "adapter_config.json"), "w") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
