"""The fine-tuning front ends' flags: `FinetuneConfig`'s and the encoders'.

Importing this module does not import TensorFlow.
"""

from tfgpt.config.finetuning import FinetuneConfig
from tfgpt.config.models import FAMILIES, FINETUNING_FAMILIES, family_of_preset
from tfgpt.training.flags import parse_config_flags, require_model_fields

ENCODER_CONFIG_CLASSES = tuple(FAMILIES[name].config_class for name in FINETUNING_FAMILIES)


def _check_random_model(config, model_overrides):
    # With --init the architecture comes from the checkpoint, checked when
    # it is read; a random model is checked here, before anything is built.
    if not config.init:
        family = family_of_preset(config.preset)
        require_model_fields(family.config_class, model_overrides, config.preset, family.name)


def parse_flags(argv=None, description="Fine-tune an encoder.", options_class=None):
    """Parses `argv` into `(FinetuneConfig, model_overrides)`.

    Every FinetuneConfig field is a flag; so is every BertConfig and
    AlbertConfig field except `max_sequence_length` (the input length
    here; a random model keeps its preset's position table). Model flags
    shape a random model (`--init ""`); with `--init` only `--dropout`
    may differ from the checkpoint's architecture. Invalid values exit
    with status 2 and one `error:` line.

    With `options_class` (`tfgpt.config.distribution`), its flags are
    added and `(FinetuneConfig, model_overrides, options)` returned.
    """
    return parse_config_flags(
        argv,
        description,
        "%(prog)s --train-file FILE [--init DIR] [--task {classification,squad}] [options]",
        FinetuneConfig,
        (
            "model (a random --preset; only --dropout with --init)",
            ENCODER_CONFIG_CLASSES,
            ("max_sequence_length",),
            "the preset's value, or --init's",
        ),
        _check_random_model,
        options_class,
    )
