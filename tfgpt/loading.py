"""Load a GPT and its tokenizer from a directory, whatever wrote it.

Two layouts are recognised by their `config.json`:

- a tfgpt run directory (`tfgpt.training`, or `python -m tfgpt.convert
  to-tfgpt`): `config.json` with the GPTConfig fields under `"model"`,
  `ckpt-N/` checkpoints of any layout (`tfgpt.checkpoint`) and the tokenizer,
  `tokenizer.model` (SentencePiece, `pipelines.tokenizer`) or GPT-2's
  `vocab.json` + `merges.txt`;
- a Hugging Face GPT-2 directory (`"model_type": "gpt2"`), read by
  `tfgpt.convert.load_gpt2_checkpoint`.
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
from tfgpt.convert import load_gpt2_checkpoint
from tfgpt.convert_decoders import ARCHITECTURES, load_hf_decoder
from tfgpt.models.gpt import GPT
from tfgpt.tokenizers import check_tokenizer_matches_model
from tfgpt.tokenizers.byte_pair_tokenizer import BytePairTokenizer


def load_model(directory, dtype=None):
    """Returns `(model, tokenizer)` restored from `directory`.

    Args:
        directory: str. A tfgpt run directory, or a transformers GPT-2,
            Llama, Mistral or Qwen2 checkpoint directory.
        dtype: optional Keras dtype policy for the model, e.g.
            `"mixed_bfloat16"`; float32 by default.

    Returns:
        The GPT with its weights, and the tokenizer (`pipelines.tokenizer.
        Tokenizer` or `BytePairTokenizer`), or None when the directory has no
        tokenizer file (Llama, Mistral and Qwen2 tokenizers are not read yet).
    """
    config = _read_json(directory, CONFIG_FILE)
    if config.get("model_type") == "gpt2":
        return load_gpt2_checkpoint(directory, dtype=dtype)
    if config.get("model_type") in ARCHITECTURES:
        return load_hf_decoder(directory, dtype=dtype), None
    if not isinstance(config.get("model"), dict):
        raise ValueError(
            f"{os.path.join(directory, CONFIG_FILE)} is neither a tfgpt run config "
            "(a 'model' section with the GPTConfig fields) nor a transformers decoder's "
            f"(model_type gpt2, {', '.join(ARCHITECTURES)}). Received keys: {sorted(config)}"
        )
    model_config = GPTConfig(**config["model"])
    model = GPT(**dataclasses.asdict(model_config), dtype=dtype)
    tokenizer = load_tokenizer(directory)
    if tokenizer is not None:
        check_tokenizer_matches_model(tokenizer, model)
    load_weights(directory, model)
    return model, tokenizer


def save_model(directory, model, tokenizer=None):
    """Writes `model` as a tfgpt run directory that `load_model` reads.

    `config.json` holds the model's GPTConfig under `"model"` and the weights
    go to `ckpt-0`, as a one-process run writes them (`tfgpt.checkpoint`);
    a `BytePairTokenizer` is saved as `vocab.json` and `merges.txt`, a
    SentencePiece one as `tokenizer.model`.
    """
    fields = {field.name: getattr(model, field.name) for field in dataclasses.fields(GPTConfig)}
    write_run_files(directory, {"model": fields})
    save_weights(directory, model)
    if isinstance(tokenizer, BytePairTokenizer):
        tokenizer.save(directory)
    elif tokenizer is not None:
        with open(os.path.join(directory, TOKENIZER_FILE), "wb") as file:
            file.write(tokenizer.model_proto)


def load_tokenizer(directory):
    """Returns the tokenizer saved in `directory`, or None if there is none."""
    if os.path.exists(os.path.join(directory, TOKENIZER_FILE)):
        from pipelines.tokenizer import Tokenizer  # SentencePiece, from the data

        return Tokenizer.load(os.path.join(directory, TOKENIZER_FILE))
    if os.path.exists(os.path.join(directory, "vocab.json")):
        return BytePairTokenizer.from_directory(directory)
    return None


def _read_json(directory, name):
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Checkpoint directory not found: {directory}")
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No {name} in {directory}: expected {path}")
    with open(path) as file:
        return json.load(file)
