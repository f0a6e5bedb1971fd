"""The contract every tfgpt model keeps, checked the same way for each family.

Like keras-hub's `run_backbone_test`: a model built from its config dataclass
takes exactly the config's fields, returns them from `get_config()` under
their own names, survives `from_config` and a `.keras` file with identical
outputs, has the expected output shapes and parameter count, and keeps
float32 variables and logits under mixed precision.
"""

import dataclasses
import inspect

import keras
import numpy as np

from tfgpt.models.encoder_pretraining_model import EncoderPretrainingModel


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


def run_encoder_contract(cls, config, inputs, tmp_path, parameter_count, **options):
    """`run_model_contract` for a BERT or ALBERT backbone or pretraining model.

    The output shapes follow from `config` and `inputs`: a pretraining
    model's `inputs` hold `mask_positions` (B, P), and its masked-LM and
    sentence-pair logits must stay float32. `options` are
    `run_model_contract`'s.
    """
    batch, length = inputs["token_ids"].shape
    shapes = {
        "sequence_output": (batch, length, config.hidden_dim),
        "pooled_output": (batch, config.hidden_dim),
    }
    logits = ()
    if issubclass(cls, EncoderPretrainingModel):
        logits = ("mlm_logits", f"{cls.pair_task}_logits")
        positions = inputs["mask_positions"].shape[1]
        shapes.update({logits[0]: (batch, positions, config.vocabulary_size), logits[1]: (batch, 2)})
    return run_model_contract(
        cls,
        config,
        inputs,
        shapes,
        tmp_path,
        float32_outputs=logits,
        parameter_count=parameter_count,
        **options,
    )


def check_presets(family):
    """Every preset of `family` lists every config field and builds its config."""
    names = {field.name for field in dataclasses.fields(family.config_class)}
    for name, preset in family.presets.items():
        assert set(preset) == names, name
        assert dataclasses.asdict(family.config_class.from_preset(name)) == preset
