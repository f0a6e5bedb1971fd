"""Load a GPT and its tokenizer from a directory, whatever wrote it.

Two layouts are recognised by their `config.json`:

- a tfgpt run directory (`tfgpt.training`, or `python -m tfgpt.convert
  to-tfgpt`): `config.json` with the GPTConfig fields under `"model"`,
  `ckpt-N/` checkpoints of any layout (`tfgpt.checkpoint`) and the tokenizer,
  `tokenizer.model` (SentencePiece, `pipelines.tokenizer`), a Hugging Face
  `tokenizer.json` (its data's; `config.json`'s `eos_token_id` gives its
  end-of-text id) or GPT-2's `vocab.json` + `merges.txt`;
- a Hugging Face decoder directory, of any decoder family's `model_type`
  (`tfgpt.models.decoder_families`): read by
  `tfgpt.convert_decoders.load_hf_decoder`, with the tokenizer of
  `load_hf_tokenizer`, or by the family's own reader where it has one
  (GPT-2's `tfgpt.convert.load_gpt2_checkpoint`).
"""

import dataclasses
import json
import os

from tfgpt.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    load_weights,
    save_weights,
    write_run_files,
)
from tfgpt.config import GPTConfig
from tfgpt.convert_decoders import ARCHITECTURES, converter, load_hf_decoder
from tfgpt.hf_files import tokenizer_file
from tfgpt.models.adapters import add_run_adapters, load_adapters, merged
from tfgpt.models.gpt import GPT
from tfgpt.tokenizers import check_tokenizer_matches_model
from tfgpt.tokenizers.byte_pair_tokenizer import TOKENIZER_JSON_FILE, BytePairTokenizer
from tfgpt.tokenizers.tokenizer_json import TOKENIZER_CONFIG_FILE


def load_model(directory, dtype=None, merge_adapters=True):
    """Returns `(model, tokenizer)` restored from `directory`.

    Args:
        directory: str. A tfgpt run directory, or a transformers GPT-2,
            Llama, Mistral or Qwen2 checkpoint directory.
        dtype: optional Keras dtype policy for the model, e.g.
            `"mixed_bfloat16"`; float32 by default.
        merge_adapters: bool. Fold a run's adapters into its kernels; False
            keeps them as they trained (`tfgpt.models.adapters`).

    Returns:
        The GPT with its weights (a run that trained `--lora-rank` adapters:
        with them folded into its kernels, `merged`, unless `merge_adapters`
        is False), and the tokenizer (`pipelines.tokenizer.
        Tokenizer` or `BytePairTokenizer`); for a tfgpt run directory, None
        when it has no tokenizer file. A Hugging Face directory without one
        is a ValueError (`load_hf_tokenizer`).
    """
    config = _read_json(directory, CONFIG_FILE)
    if config.get("model_type") in ARCHITECTURES:
        family_conversion = converter(config["model_type"])
        if hasattr(family_conversion, "load_checkpoint"):  # the family's own reader
            return family_conversion.load_checkpoint(directory, dtype=dtype)
        tokenizer = load_hf_tokenizer(directory)
        model = load_hf_decoder(directory, dtype=dtype)
        check_tokenizer_matches_model(tokenizer, model)
        return model, tokenizer
    if not isinstance(config.get("model"), dict):
        raise ValueError(
            f"{os.path.join(directory, CONFIG_FILE)} is neither a tfgpt run config "
            "(a 'model' section with the GPTConfig fields) nor a transformers decoder's "
            f"(model_type {', '.join(ARCHITECTURES)}). Received keys: {sorted(config)}"
        )
    model_config = GPTConfig(**config["model"])
    model = GPT(**dataclasses.asdict(model_config), dtype=dtype)
    tokenizer = load_tokenizer(directory)
    if tokenizer is not None:
        check_tokenizer_matches_model(tokenizer, model)
    if add_run_adapters(model, config.get("train") or {}):  # trained adapters: folded in
        load_adapters(directory, model)
        return (merged(model) if merge_adapters else model), tokenizer
    load_weights(directory, model)
    return model, tokenizer


def save_model(directory, model, tokenizer=None, chat_template=None):
    """Writes `model` as a tfgpt run directory that `load_model` reads.

    `config.json` holds the model's GPTConfig under `"model"` (and the
    `pipelines.chat_template.ChatTemplate` `chat_template`, if given, under
    `"chat_template"`) and the weights go to `ckpt-0`, as a one-process run
    writes them (`tfgpt.checkpoint`); a `BytePairTokenizer` is saved as
    `vocab.json` and `merges.txt` (and the `tokenizer.json` it was read from,
    its end-of-text id as `eos_token_id` in `config.json`), a SentencePiece
    one as `tokenizer.model`.
    """
    fields = {field.name: getattr(model, field.name) for field in dataclasses.fields(GPTConfig)}
    record = {"model": fields}
    if isinstance(tokenizer, BytePairTokenizer) and tokenizer.eos_id is not None:
        record["eos_token_id"] = tokenizer.eos_id
    if chat_template is not None:
        record["chat_template"] = chat_template.spec()
    write_run_files(directory, record)
    save_weights(directory, model)
    if isinstance(tokenizer, BytePairTokenizer):
        tokenizer.save(directory)
    elif tokenizer is not None:
        with open(os.path.join(directory, TOKENIZER_FILE), "wb") as file:
            file.write(tokenizer.model_proto)


def load_tokenizer(directory):
    """Returns the tokenizer saved in a tfgpt run `directory`, or None if there is none
    (a run trained on data prepared with a Hugging Face `tokenizer.json` holds that)."""
    if tokenizer_file(directory) is not None:
        return load_hf_tokenizer(directory)
    if os.path.exists(os.path.join(directory, "vocab.json")):
        return BytePairTokenizer.from_directory(directory)
    return None


def load_hf_tokenizer(directory):
    """Returns the tokenizer of a Hugging Face decoder directory.

    Picks, in order: `tokenizer.json` (byte-level BPE: GPT-2, GPT-J, GPT-Neo,
    GPT-NeoX, Llama 3, Qwen2); `tokenizer.model` (SentencePiece: Llama 2,
    Mistral), which is also read when the `tokenizer.json` beside it is not
    byte-level (Llama 2 and Mistral ship both); GPT-2's `vocab.json` and
    `merges.txt`. A SentencePiece tokenizer puts the bos id first unless
    `tokenizer_config.json` sets `add_bos_token` false, as transformers'
    `LlamaTokenizer` does.

    Args:
        directory: str. The checkpoint directory.

    Returns:
        A `BytePairTokenizer` or a `pipelines.tokenizer.Tokenizer`.
    """
    path = tokenizer_file(directory)
    if path is not None and path.endswith(TOKENIZER_JSON_FILE):
        return BytePairTokenizer.from_tokenizer_json(path)
    if path is not None:
        return _sentencepiece(directory)
    if all(os.path.isfile(os.path.join(directory, name)) for name in ("vocab.json", "merges.txt")):
        return BytePairTokenizer.from_directory(directory)
    raise ValueError(
        f"No tokenizer in {directory}: expected {TOKENIZER_JSON_FILE}, {TOKENIZER_FILE}, "
        "or vocab.json and merges.txt"
    )


def _sentencepiece(directory):
    """`directory/tokenizer.model`, adding the bos id as `tokenizer_config.json` says."""
    from pipelines.tokenizer import Tokenizer  # SentencePiece, from the data

    config_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    add_bos = True
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as file:
            add_bos = bool(json.load(file).get("add_bos_token", True))
    return Tokenizer.load(os.path.join(directory, TOKENIZER_FILE), add_bos=add_bos)


def _read_json(directory, name):
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Checkpoint directory not found: {directory}")
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No {name} in {directory}: expected {path}")
    with open(path) as file:
        return json.load(file)
