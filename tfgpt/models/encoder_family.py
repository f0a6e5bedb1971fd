"""What an encoder family's folder declares: its config, presets, tasks, models and conversion."""

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class EncoderFamily:
    """One family of encoders: a config dataclass, its backbone and its pretraining model.

    Each family is a folder of `tfgpt/models/` (`bert/`, `albert/`,
    `roberta/`) whose `__init__.py` declares its `FAMILY`, importing no
    TensorFlow, and `tfgpt.models.encoder_families` lists them. The generic
    code reads everything from there: the presets and tasks
    (`tfgpt.config.FAMILIES`, `--preset`, `--task`), the fine-tuning front
    ends' families (`tfgpt.config.FINETUNING_FAMILIES`) and the Hugging Face
    conversion (`tfgpt.convert_encoders`). The config dataclass stays in
    `tfgpt.config.models` with the other families' (one source of truth for
    the fields, flags and checks), named here.

    The conversion module (`hf_conversion.py` in the folder) defines `LAYOUT`,
    a `tfgpt.convert_encoders.EncoderLayout`: the family's `config.json` keys
    and the transformers names of its tensors, which `convert_encoders` reads
    and writes both ways.

    Args:
        name: str. The folder's name, the transformers `model_type` of its
            checkpoints and the `family` a run's `config.json` records.
        title: str. The name it is written with in messages (`"RoBERTa"`).
        config_class: str. The name of its config dataclass in
            `tfgpt.config.models` (`"BertConfig"`).
        presets: dict. Preset name -> the config fields it sets (the
            config's defaults fill in the rest: `tfgpt.config.FAMILIES`).
        tasks: tuple of str. Pretraining tasks it trains; the first is what
            `--task auto` picks, and the part after its `+` the family's
            sentence-pair task (`tfgpt.config.Family.pair_task`).
        backbone: str. `"module:Class"` of the backbone.
        pretraining_model: str. `"module:Class"` of the backbone with its
            pretraining heads.
        conversion: str. The module of its Hugging Face conversion.
        finetuning: bool. Whether the fine-tuning front ends take it.
    """

    name: str
    title: str
    config_class: str
    presets: dict
    tasks: tuple
    backbone: str
    pretraining_model: str
    conversion: str
    finetuning: bool

    def converter(self):
        """The family's conversion module (imported now: it may import TensorFlow)."""
        return importlib.import_module(self.conversion)
