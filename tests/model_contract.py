"""The contract every tfgpt model keeps, checked the same way for each family.

Like keras-hub's `run_backbone_test`: a model built from its config dataclass
takes exactly the config's fields, returns them from `get_config()` under
their own names, survives `from_config` and a `.keras` file with identical
outputs, has the expected output shapes and parameter count, and keeps
float32 variables and logits under mixed precision.
"""

import contextlib
import dataclasses
import inspect

import keras
import numpy as np
import pytest

from tfgpt.models.encoder_pretraining_model import EncoderPretrainingModel

# Tiny sizes the families' tests share, distinct so that no two dimensions
# can be confused for each other.
VOCAB, LAYERS, HEADS, HIDDEN, INTERMEDIATE, MAX_LENGTH = 37, 3, 3, 12, 20, 16


def tiny_fields(**overrides):
    """The shared fields of a tiny model of any family, `overrides` on top."""
    sizes = dict(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        max_sequence_length=MAX_LENGTH,
    )
    return {**sizes, **overrides}


def output_shapes(outputs):
    return keras.tree.map_structure(lambda tensor: tuple(tensor.shape), outputs)


def run_model_contract(
    cls,
    config,
    inputs,
    expected_shapes,
    tmp_path,
    float32_outputs=(),
    parameter_count=None,
    prepare=None,
    mixed_policy="mixed_bfloat16",
):
    """Checks `cls` built from the config dataclass instance `config`.

    Args:
        cls: a `ConfiguredModel` subclass.
        config: an instance of `cls.config_class`, preferably with
            non-default values so that a dropped field shows.
        inputs: what the model is called on.
        expected_shapes: the outputs' shapes, in the outputs' structure.
        tmp_path: a directory for the `.keras` file.
        float32_outputs: keys of the dict outputs (or "" for a single
            tensor) that must stay float32 under mixed precision.
        parameter_count: int or None. The exact `count_params()`.
        prepare: optional function applied to the model before it is
            called (e.g. adding noise to its weights).
        mixed_policy: str. The mixed-precision policy to check.

    Returns:
        The model.
    """
    fields = dataclasses.asdict(config)
    model = cls(**fields)
    if prepare is not None:
        prepare(model)

    # Constructor arguments = config fields = get_config() keys.
    assert model.config == config
    arguments = set(inspect.signature(cls).parameters) - {"kwargs"}
    assert arguments == set(fields)
    model_config = model.get_config()
    assert {name: model_config[name] for name in fields} == fields
    assert {name: getattr(model, name) for name in fields} == fields
    clone = cls.from_config(model_config)
    assert clone.get_config() == model_config
    assert cls(**dataclasses.asdict(clone.config)).config == config

    # Output shapes, and a .keras file that gives the same outputs.
    outputs = model(inputs)
    assert output_shapes(outputs) == expected_shapes
    path = tmp_path / f"{cls.__name__}.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored) is cls
    assert restored.get_config() == model_config
    for actual, expected in zip(keras.tree.flatten(restored(inputs)), keras.tree.flatten(outputs)):
        np.testing.assert_array_equal(actual.numpy(), expected.numpy())

    if parameter_count is not None:
        assert model.count_params() == parameter_count

    # Mixed precision: float32 variables and float32 logits.
    mixed = cls(**fields, dtype=mixed_policy)
    mixed_outputs = mixed(inputs)
    assert {variable.dtype for variable in mixed.weights} == {"float32"}
    for key in float32_outputs:
        tensor = mixed_outputs[key] if key else mixed_outputs
        assert tensor.dtype == "float32", key
    return model


def run_encoder_contract(
    cls, config, inputs, mask_positions, tmp_path, backbone_count, heads_count, **options
):
    """`run_model_contract` for a BERT, ALBERT or RoBERTa backbone or pretraining model.

    A pretraining model is called with `mask_positions` (B, P) added to
    `inputs`, counts `backbone_count + heads_count` parameters and keeps its
    masked-LM and any sentence-pair logits float32; a backbone counts
    `backbone_count`. The output shapes follow from `config` and the inputs.
    `options` are `run_model_contract`'s.
    """
    batch, length = inputs["token_ids"].shape
    shapes = {
        "sequence_output": (batch, length, config.hidden_dim),
        "pooled_output": (batch, config.hidden_dim),
    }
    logits = ()
    if issubclass(cls, EncoderPretrainingModel):
        inputs = {**inputs, "mask_positions": mask_positions}
        backbone_count += heads_count
        logits = ("mlm_logits",)
        shapes["mlm_logits"] = (batch, mask_positions.shape[1], config.vocabulary_size)
        if cls.pair_task is not None:
            logits += (f"{cls.pair_task}_logits",)
            shapes[f"{cls.pair_task}_logits"] = (batch, 2)
    return run_model_contract(
        cls,
        config,
        inputs,
        shapes,
        tmp_path,
        float32_outputs=logits,
        parameter_count=backbone_count,
        **options,
    )


def check_presets(family, unknown_field):
    """Every preset of `family` lists every config field and builds its
    config; a preset builds a model with an override, whose sentence-pair
    task is the registry's; an unknown preset, or a field of the config it
    does not have (`unknown_field`), raises."""
    config_class = family.config_class
    names = {field.name for field in dataclasses.fields(config_class)}
    for name, preset in family.presets.items():
        assert set(preset) == names, name
        assert dataclasses.asdict(config_class.from_preset(name)) == preset
    smallest = min(family.presets, key=lambda name: family.presets[name]["hidden_dim"])
    model = family.pretraining_class().from_preset(smallest, num_layers=2)
    assert model.config.num_layers == 2
    # The registry's sentence-pair task is the one the model's head predicts.
    assert family.pair_task == getattr(model, "pair_task", None)
    with pytest.raises(ValueError, match=r"preset='no-such-model'"):
        config_class.from_preset("no-such-model")
    with pytest.raises(ValueError, match=rf"Unknown {config_class.__name__} .*{unknown_field}"):
        config_class.from_preset(smallest, **{unknown_field: 3})


# ---- Errors -----------------------------------------------------------------

# Bad values of the fields every family has, and what the error must say.
BAD_COMMON_FIELDS = [
    ({"hidden_dim": 10, "num_heads": 4}, r"divisible.*hidden_dim=10, num_heads=4"),
    ({"num_layers": 0}, r"positive integer.*num_layers=0"),
    ({"vocabulary_size": 2.5}, r"vocabulary_size=2.5"),
    ({"dropout": 1.0}, r"\[0, 1\).*dropout=1.0"),
    ({"dropout": -0.1}, r"dropout=-0.1"),
    ({"dropout": "0.1"}, r"dropout='0.1'"),
    ({"activation": "swish"}, r"activation='swish'"),
    ({"norm_first": "yes"}, r"bool.*norm_first='yes'"),
    ({"norm_first": 1}, r"norm_first=1"),
    ({"layer_norm_epsilon": 0}, r"positive.*layer_norm_epsilon=0"),
    ({"layer_norm_epsilon": "small"}, r"layer_norm_epsilon='small'"),
]


def check_bad_config(cls, fields, overrides, message):
    """`cls` built from `fields` with `overrides`, and its config dataclass
    with them, raise a ValueError matching `message`."""
    with pytest.raises(ValueError, match=message):
        cls(**{**fields, **overrides})
    with pytest.raises(ValueError, match=message):
        cls.config_class(**{**dataclasses.asdict(cls.config_class()), **overrides})


# ---- Published parameter counts ---------------------------------------------


def fast_then_slow(fast, slow):
    """Parameters for `pytest.mark.parametrize`, those in `slow` marked slow."""
    return [*fast, *(pytest.param(name, marks=pytest.mark.slow) for name in slow)]


@contextlib.contextmanager
def shapes_only():
    """Models built inside have variables of their shapes and no values:
    `count_params` counts a 1.5-billion-parameter preset in a second, where
    drawing its initial weights takes a minute and 6 GB.

    The variables are dropped from Keras's list of those to initialise on
    the way out: the next stateless scope would otherwise draw them all.
    """
    from keras.src.backend.common import global_state

    before = list(global_state.get_global_attribute("uninitialized_variables", []))
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        global_state.set_global_attribute("uninitialized_variables", before)


def check_encoder_parameter_counts(
    pretraining_class, preset, backbone_count, pretraining_count, backbone_formula, heads_formula
):
    """An encoder preset has the published counts, by formula and as built."""
    config = pretraining_class.config_class.from_preset(preset)
    assert backbone_formula(config) == backbone_count
    assert backbone_count + heads_formula(config) == pretraining_count
    with shapes_only():
        model = pretraining_class(**dataclasses.asdict(config))
    assert model.backbone.count_params() == backbone_count
    assert model.count_params() == pretraining_count


def check_transformers_parameter_counts(
    family, config, backbone_count, pretraining_count, **family_fields
):
    """transformers' `{family}Model` and `{family}ForPreTraining` of the same
    shape count the same. Fails (not skips) without torch/transformers: they
    are test requirements."""
    import torch
    import transformers

    hf_config = getattr(transformers, f"{family}Config")(
        vocab_size=config.vocabulary_size,
        hidden_size=config.hidden_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_dim,
        max_position_embeddings=config.max_sequence_length,
        type_vocab_size=config.num_segments,
        **family_fields,
    )
    with torch.device("meta"):  # Shapes only: nothing is allocated.
        backbone = getattr(transformers, f"{family}Model")(hf_config)
        pretraining = getattr(transformers, f"{family}ForPreTraining")(hf_config)
    assert sum(p.numel() for p in backbone.parameters()) == backbone_count
    assert sum(p.numel() for p in pretraining.parameters()) == pretraining_count
