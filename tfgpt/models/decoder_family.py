"""What a decoder family's folder declares: its presets, model types and conversion."""

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class DecoderFamily:
    """One family of decoders: tfgpt's one GPT (`tfgpt.models.gpt`) with its choice of switches.

    Each family is a folder of `tfgpt/models/` (`llama/`: Llama, Mistral and
    Qwen2) whose `__init__.py` declares its `FAMILY`, importing no
    TensorFlow, and `tfgpt.models.decoder_families` lists them. The generic
    code reads everything from there: the presets (`tfgpt.config.FAMILIES`,
    `--preset`), the transformers model types (`tfgpt.convert_decoders`,
    `tfgpt.loading`, `tfgpt.convert`). The backbone is the one GPT and its
    tensor-parallel split rules the block's
    (`tfgpt.parallel.tensor_parallel.SPLIT_RULES`, by variable path), so a
    family whose switches the block has declares neither.

    The conversion module (`hf_conversion.py` in the folder) defines:

    - `config_from_hf(hf_config, model_type, source)`: the `GPTConfig` of a
      `config.json` dict (`source` names the file in errors);
    - `hf_config(config, model_type)`: the `config.json` dict of a
      `GPTConfig`, or a ValueError naming the switch `model_type` lacks;
    - `weight_map(model, model_type)`: `(variable, hf_names, layout)` of every
      weight (`tfgpt.convert_decoders.weight_map`);

    and, where the family's own reader or adapter writer replaces the
    generic one (GPT-2: its `vocab.json` tokenizer, its Conv1D adapters),
    `load_checkpoint(directory, dtype)` -> `(model, tokenizer)` and
    `save_adapter(model, directory, model_type, base_model_name_or_path)`.

    Args:
        name: str. The folder's name.
        architectures: dict. Each transformers `model_type` the family reads
            and writes -> the `architectures` entry of its `config.json`.
        presets: dict. Preset name -> the `GPTConfig` fields it sets (the
            config's defaults fill in the rest: `tfgpt.config.FAMILIES`).
        conversion: str. The module of its Hugging Face conversion.
    """

    name: str
    architectures: dict
    presets: dict
    conversion: str

    def converter(self):
        """The family's conversion module (imported now: it may import TensorFlow)."""
        return importlib.import_module(self.conversion)
