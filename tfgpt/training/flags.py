"""Command-line flags generated from the config dataclasses.

Every field of `TrainConfig` and of the model config is a flag of the same
name with dashes (`batch_size` -> `--batch-size`). `--preset` applies first
and explicit model flags override its fields. An unknown flag or a value of
the wrong type is an error, never a silent default.
"""

import argparse
import dataclasses
import typing

from tfgpt.config import AlbertConfig, BertConfig, GPTConfig, TrainConfig, family_of_preset

MODEL_CONFIGS = (GPTConfig, BertConfig, AlbertConfig)


def _flag(name):
    return "--" + name.replace("_", "-")


def _add_fields(parser, cls, defaults, seen=None):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if seen is not None:
            if field.name in seen:
                continue
            seen.add(field.name)
        kind = hints[field.name]
        default = defaults.get(field.name, None)
        if kind is bool:
            parser.add_argument(
                _flag(field.name), action=argparse.BooleanOptionalAction, default=default
            )
        else:
            parser.add_argument(_flag(field.name), type=kind, default=default)


def build_parser(description):
    """Returns a parser with one flag per TrainConfig field and per model
    config field (the union of GPTConfig, BertConfig and AlbertConfig)."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train_defaults = {
        field.name: field.default for field in dataclasses.fields(TrainConfig)
    }
    training = parser.add_argument_group("training")
    _add_fields(training, TrainConfig, train_defaults)
    # Model flags default to None: "take the preset's value".
    model = parser.add_argument_group("model (override the preset)")
    seen = set()
    for cls in MODEL_CONFIGS:
        _add_fields(model, cls, {}, seen)
    return parser


def parse_flags(argv=None, description="Train a GPT.", add_arguments=None):
    """Parses `argv` into `(TrainConfig, model_overrides)`.

    `model_overrides` holds only the model fields given as flags; the
    trainer applies them over the preset (and the data's vocabulary size).
    Invalid values exit with status 2 and one `error:` line naming the flag,
    before anything is built.

    `add_arguments(parser)` may add a front end's own flags (and return
    their names); their values are then returned as a third element, a
    dict, after validation by `add_arguments`'s argparse types.
    """
    parser = build_parser(description)
    extra_names = add_arguments(parser) if add_arguments else ()
    args = vars(parser.parse_args(argv))
    extras = {name: args.pop(name) for name in extra_names}
    train_fields = {field.name for field in dataclasses.fields(TrainConfig)}
    train_args = {key: value for key, value in args.items() if key in train_fields}
    model_overrides = {
        key: value
        for key, value in args.items()
        if key not in train_fields and value is not None
    }
    try:
        train_config = TrainConfig(**train_args)
        family = family_of_preset(train_config.preset)
        family.resolve_task(train_config.task)
        cls = family.config_class
        fields = {field.name for field in dataclasses.fields(cls)}
        for name in model_overrides:
            if name not in fields:
                raise ValueError(
                    f"--{name.replace('_', '-')} is not a {cls.__name__} field "
                    f"(--preset {train_config.preset} is a {family.name} model)"
                )
        cls.from_preset(train_config.preset, **model_overrides)
    except ValueError as error:
        parser.error(str(error))
    if add_arguments:
        return train_config, model_overrides, extras
    return train_config, model_overrides
