"""Command-line flags generated from the config dataclasses.

Every field of a run config (`TrainConfig`, `FinetuneConfig`) and of the
model configs is a flag of the same name with dashes (`batch_size` ->
`--batch-size`); so is every field of the front end's distribution options
(`tfgpt.config.distribution`). Each flag's help is its field's `Args:` entry
in the dataclass's docstring (a subclass's entry replaces its base's), an
enumerated field lists its choices, and defaults are shown. `--preset`
applies first and explicit model flags override its fields. An unknown
flag or a value of the wrong type is an error, never a silent default.

Importing this module does not import TensorFlow (`--help` runs without it).
"""

import argparse
import dataclasses
import re
import textwrap
import typing

from tfgpt.cli import HelpFormatter
from tfgpt.config.distribution import FRONT_ENDS
from tfgpt.config.models import (
    ACTIVATIONS,
    FAMILIES,
    FEEDFORWARDS,
    NORMS,
    POSITIONS,
    RESIDUALS,
    ROPE_SCALINGS,
    WINDOW_LAYERS,
    family_of_preset,
)
from tfgpt.config.training import TrainConfig

MODEL_CONFIG_CLASSES = tuple(family.config_class for family in FAMILIES.values())
# Enumerated model fields (the model configs validate them).
MODEL_CHOICES = {"activation": ACTIVATIONS, "norm": NORMS, "positions": POSITIONS,
                 "rope_scaling": ROPE_SCALINGS, "feedforward": FEEDFORWARDS,
                 "residual": RESIDUALS, "window_layers": WINDOW_LAYERS}

# `name: type. meaning` or `name (type): meaning`, the first line of an entry.
_ENTRY = re.compile(r"^(?P<indent>\s*)(?P<name>\w+)\s*(\([^)]*\))?:\s*(?P<text>.*)$")
# The type that opens an entry's text: `int.`, `tuple of str.`, `str or None.`
_TYPE_WORD = r"(?:int|float|str|bool|dict|list|tuple|type|callable|None)"
_TYPE = re.compile(
    rf"^{_TYPE_WORD}(?:\s+(?:of|or)\s+{_TYPE_WORD}|\[[^\]]*\]|\s*\|\s*{_TYPE_WORD})*\.\s+"
)


def docstring_args(cls):
    """`{field name: meaning}` from the `Args:` sections of `cls` and its bases.

    An entry is `name: type. meaning`, possibly over several lines indented
    deeper than the name; the type is dropped and the lines are joined. A
    subclass's entry replaces its base's.
    """
    entries = {}
    for klass in reversed(cls.__mro__):
        entries.update(_parse_args_section(klass.__doc__ or ""))
    return entries


def _parse_args_section(doc):
    lines = textwrap.dedent("\n".join(doc.splitlines()[1:])).splitlines()
    entries, name, indent, inside = {}, None, None, False
    for line in lines:
        if not inside:
            inside = line.strip() == "Args:"
            continue
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        match = _ENTRY.match(line)
        if match and (indent is None or depth == indent):
            indent, name = depth, match["name"]
            entries[name] = match["text"].strip()
        elif indent is not None and depth > indent and name:
            entries[name] += " " + line.strip()
        else:  # the section ends: a header or text at a shallower indent
            break
    return {key: _TYPE.sub("", text, count=1) for key, text in entries.items()}


class FlagHelpFormatter(HelpFormatter):
    """`tfgpt.cli.HelpFormatter` that wraps help only at spaces: flag and
    preset names (`--warmup-steps`, `albert-large`) stay whole."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _flag(name):
    return "--" + name.replace("_", "-")


def _help(text):
    return text.replace("%", "%%")  # argparse %-formats help strings


def _own_fields_first(cls):
    """The fields of `cls`, those it adds before those it inherits."""
    fields = dataclasses.fields(cls)
    inherited = set()
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            inherited |= {field.name for field in dataclasses.fields(base)}
    own = [field for field in fields if field.name not in inherited]
    return own + [field for field in fields if field.name in inherited]


def add_config_flags(group, cls):
    """One flag per field of the dataclass `cls`, its default the field's."""
    hints = typing.get_type_hints(cls)
    helps = docstring_args(cls)
    choices = getattr(cls, "CHOICES", {})
    presets = getattr(cls, "PRESETS", None)
    for field in _own_fields_first(cls):
        text = helps.get(field.name)
        if text is None:
            raise ValueError(f"{cls.__name__}.{field.name} has no `Args:` entry to be its help")
        if field.name == "preset" and presets:
            text += f" One of: {', '.join(presets)}."
        _add_flag(group, field.name, hints[field.name], _help(text), field.default,
                  choices.get(field.name))


# What a value looks like in `--help`: `--steps N`, `--learning-rate X`,
# `--data DIR`; other strings show their flag's name.
_METAVARS = {int: "N", float: "X"}
_STRING_METAVARS = {
    "data": "DIR", "out": "DIR", "init": "DIR", "preset": "NAME", "tokenizer": "PATH",
    "train_file": "FILE", "validation_file": "FILE", "labels": "A,B,...",
    "profile_steps": "START,END",
}


def _add_flag(group, name, kind, help_text, default, choices=None):
    if kind is bool:
        group.add_argument(_flag(name), action=argparse.BooleanOptionalAction, default=default,
                           help=help_text)
        return
    if kind is str and default is not argparse.SUPPRESS:
        help_text += " (default: %(default)r)"  # shows an empty default as ''
    group.add_argument(_flag(name), type=kind, default=default, choices=choices,
                       metavar=None if choices else _METAVARS.get(
                           kind, _STRING_METAVARS.get(name, name.upper())),
                       help=help_text)


def _title(cls):
    """A flag group's title: the class and its docstring's summary line."""
    summary = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")
    return f"{summary} ({cls.__name__})"


def add_model_flags(group, model_classes, skip=(), default_text="the preset's value"):
    """The union of `model_classes`' fields as flags, absent unless given.

    A field of some families only says which; the help is the first
    class's entry for the field.
    """
    seen = set(skip)
    for cls in model_classes:
        hints = typing.get_type_hints(cls)
        helps = docstring_args(cls)
        for field in dataclasses.fields(cls):
            if field.name in seen:
                continue
            seen.add(field.name)
            owners = [
                family.name for family in FAMILIES.values()
                if family.config_class in model_classes
                and field.name in {f.name for f in dataclasses.fields(family.config_class)}
            ]
            text = helps.get(field.name)
            if text is None:
                raise ValueError(f"{cls.__name__}.{field.name} has no `Args:` entry to be its help")
            if len(owners) < len(model_classes):
                text += f" {' and '.join(name.upper() for name in owners)} only."
            text += f" (default: {default_text})"
            # SUPPRESS: the flag is in the parsed namespace only when given.
            _add_flag(group, field.name, hints[field.name], _help(text), argparse.SUPPRESS,
                      MODEL_CHOICES.get(field.name))


def parse_config_flags(argv, description, usage, config_class, model_group, check_model,
                       options_class=None):
    """Parses `argv` into `(config, model_overrides)`, and `options` with an `options_class`.

    Args:
        argv: list of str, or None for `sys.argv[1:]`.
        description: str. The front end's docstring, shown by `--help`.
        usage: str. The usage line: the required flags, then `[options]`.
        config_class: the run config dataclass (`TrainConfig`, ...).
        model_group: `(title, model classes, fields left out, default text)`.
        check_model: `check_model(config, model_overrides)` raises
            ValueError when the model flags do not fit the config.
        options_class: the front end's distribution options dataclass
            (`tfgpt.config.distribution`), whose flags are added and whose
            instance is returned third; or None.

    Invalid values exit with status 2 and one `error:` line naming the
    flag, before anything is built.
    """
    parser = argparse.ArgumentParser(
        usage=usage, description=description, formatter_class=FlagHelpFormatter
    )
    add_config_flags(parser.add_argument_group(_title(config_class)), config_class)
    title, model_classes, skip, default_text = model_group
    add_model_flags(parser.add_argument_group(title), model_classes, skip, default_text)
    if options_class is not None:
        add_config_flags(parser.add_argument_group(_title(options_class)), options_class)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unrecognized(unknown, options_class))
    args = vars(args)
    config_fields = {field.name for field in dataclasses.fields(config_class)}
    option_fields = (
        {field.name for field in dataclasses.fields(options_class)} if options_class else set()
    )
    config_args = {name: args.pop(name) for name in config_fields}
    option_args = {name: args.pop(name) for name in option_fields}
    model_overrides = args
    try:
        config = config_class(**config_args)
        options = options_class(**option_args) if options_class else None
        check_model(config, model_overrides)
    except ValueError as error:
        parser.error(str(error))
    return (config, model_overrides) + ((options,) if options_class else ())


def _unrecognized(unknown, options_class):
    """argparse's message, or which front end takes a distribution flag given to the other."""

    for cls, front_ends in FRONT_ENDS.items():
        if cls is options_class:
            continue
        flags = {_flag(field.name) for field in dataclasses.fields(cls)}
        for argument in unknown:
            if argument.split("=")[0] in flags:
                return f"{argument.split('=')[0]} is a flag of {front_ends}, not of this front end"
    return f"unrecognized arguments: {' '.join(unknown)}"


def require_model_fields(cls, model_overrides, preset, family_name):
    """Raises unless every override is a field of `cls`, and `cls` accepts them."""
    fields = {field.name for field in dataclasses.fields(cls)}
    for name in model_overrides:
        if name not in fields:
            raise ValueError(
                f"{_flag(name)} is not a {cls.__name__} field "
                f"(--preset {preset} is a {family_name} model)"
            )
    cls.from_preset(preset, **model_overrides)


def _check_pretraining_model(config, model_overrides):
    family = family_of_preset(config.preset)
    family.resolve_task(config.task)
    require_model_fields(family.config_class, model_overrides, config.preset, family.name)


def parse_flags(argv=None, description="Train a GPT, BERT or ALBERT.", options_class=None):
    """Parses the trainers' flags into `(TrainConfig, model_overrides)`.

    `model_overrides` holds only the model fields given as flags; the
    trainer applies them over the preset (and the data's vocabulary size).
    With `options_class` (`tfgpt.config.distribution`), its flags are
    added and `(TrainConfig, model_overrides, options)` returned.
    """
    return parse_config_flags(
        argv,
        description,
        "%(prog)s --data DIR [--preset NAME] [options]",
        TrainConfig,
        ("model (override the preset)", MODEL_CONFIG_CLASSES, (), "the preset's value"),
        _check_pretraining_model,
        options_class,
    )
