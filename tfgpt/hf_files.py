"""Reading a transformers checkpoint directory: `config.json` and its weights.

The weights are `model.safetensors`, its shards listed in
`model.safetensors.index.json`, `pytorch_model.bin` or its shards listed in
`pytorch_model.bin.index.json`, whichever the directory has, in that order.
Every family's import (`tfgpt.convert`, `convert_decoders`,
`convert_encoders`) reads them here, as `CheckpointTensors`: a mapping
whose tensors are read, and widened to float32, one at a time when asked
for, so a model loads with one copy of its weights in memory plus the
tensor being assigned, not two (a safetensors file is memory-mapped; a
`pytorch_model.bin` is opened with `torch.load(mmap=True)`, which needs
PyTorch, unless it predates torch's zip format).
"""

import collections.abc
import json
import os
import struct
import zipfile

import numpy as np

from pipelines.files import file_sha256

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # Widened to float32 when read; NumPy has no bfloat16.
    "I64": np.int64,
    "I32": np.int32,
}
# The weight files a directory may hold, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_JSON_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"


class CheckpointTensors(collections.abc.Mapping):
    """`{name: np.ndarray}` of a checkpoint, each tensor read when it is looked up.

    Args:
        readers: dict of name -> callable `()` returning the tensor.
    """

    def __init__(self, readers):
        self._readers = dict(readers)

    def __getitem__(self, name):
        return self._readers[name]()

    def __iter__(self):
        return iter(self._readers)

    def __len__(self):
        return len(self._readers)

    def renamed(self, rename):
        """The same tensors under `rename(name)`; a name it maps to None is left out."""
        readers = {}
        for name, reader in self._readers.items():
            new = rename(name)
            if new is not None:
                readers[new] = reader
        return CheckpointTensors(readers)


def read_safetensors(path):
    """The tensors of one `.safetensors` file, as `CheckpointTensors`.

    The format is an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the raw little-endian data
    (https://github.com/huggingface/safetensors). Read directly, memory-
    mapped, so that loading a checkpoint needs neither torch nor the
    safetensors package. bfloat16 tensors are widened to float32.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as file:
            header_length = struct.unpack("<Q", file.read(8))[0]
            header = json.loads(file.read(header_length))
    except (OSError, struct.error, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_length)
    readers = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}. "
                f"Supported: {', '.join(_SAFETENSORS_DTYPES)}"
            )
        begin, end = info["data_offsets"]
        if end > data.size:
            raise ValueError(
                f"{path}: tensor {name!r} lies beyond the end of the file (truncated?)"
            )

        def read(begin=begin, end=end, info=info):
            array = np.frombuffer(data[begin:end], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
            if info["dtype"] == "BF16":
                array = (array.astype(np.uint32) << 16).view(np.float32)
            return array.reshape(info["shape"])

        readers[name] = read
    return CheckpointTensors(readers)


def read_torch_file(path):
    """The tensors of one `pytorch_model.bin`, as `CheckpointTensors` (float32 when floating)."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"Reading {path} needs PyTorch (pip install torch), or convert the checkpoint "
            "to model.safetensors first"
        ) from None
    try:  # memory-mapped unless the file predates torch's zip format
        state = torch.load(path, map_location="cpu", weights_only=True,
                           mmap=zipfile.is_zipfile(path))
    except Exception as error:  # torch raises several kinds on a bad file
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({error})") from None

    def reader(tensor):
        return lambda: (tensor.float() if tensor.is_floating_point() else tensor).numpy()

    return CheckpointTensors({name: reader(tensor) for name, tensor in state.items()})


def read_weights(directory):
    """The weights of a transformers checkpoint directory, as `CheckpointTensors`."""
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            break
    else:
        found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise FileNotFoundError(
            f"No weights in {directory}: expected one of {', '.join(WEIGHT_FILES)}; "
            f"found: {found}"
        )
    read = read_safetensors if ".safetensors" in name else read_torch_file
    if not path.endswith(".index.json"):
        return read(path)
    with open(path) as file:
        shards = sorted(set(json.load(file)["weight_map"].values()))
    readers = {}
    for shard in shards:
        shard_path = os.path.join(directory, shard)
        if not os.path.exists(shard_path):
            raise FileNotFoundError(f"{path} lists {shard}, which is missing from {directory}")
        readers.update(read(shard_path)._readers)
    return CheckpointTensors(readers)


def read_hf_config(directory):
    """The parsed `config.json` of a transformers checkpoint directory."""
    config_path = os.path.join(directory, "config.json")
    try:
        with open(config_path) as file:
            config = json.load(file)
    except OSError as error:
        raise ValueError(
            f"Not a transformers checkpoint directory: cannot read {config_path} "
            f"({error.strerror})"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: malformed JSON ({error})") from None
    return config


def read_hf_checkpoint(directory):
    """`(config, tensors)`: the parsed `config.json` and the `CheckpointTensors`."""
    return read_hf_config(directory), read_weights(directory)


def model_type_of(directory):
    """The `model_type` its `config.json` gives when `directory` is a transformers
    checkpoint directory; None otherwise (a tfgpt run directory, or no config)."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return None
    config = read_hf_config(directory)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def is_byte_level(json_path):
    """Whether a `tokenizer.json` decodes bytes (GPT-2's ByteLevel decoder)."""
    with open(json_path, encoding="utf-8") as file:
        decoder = json.load(file).get("decoder") or {}
    return decoder.get("type") == "ByteLevel"


def tokenizer_file(directory):
    """The tokenizer file tfgpt reads in `directory`, or None.

    `tokenizer.json` when it is byte-level BPE (GPT-2, GPT-J, GPT-NeoX,
    Llama 3, Qwen2) or alone, else `tokenizer.model` (SentencePiece: Llama 2
    and Mistral ship it beside a `tokenizer.json` that is not byte-level).
    Data preparation, `tfgpt.loading` and `--init`'s check of the data's
    tokenizer all take this one file.
    """
    json_path = os.path.join(directory, TOKENIZER_JSON_FILE)
    model_path = os.path.join(directory, SENTENCEPIECE_FILE)
    has_model = os.path.isfile(model_path)
    if os.path.isfile(json_path) and not (has_model and not is_byte_level(json_path)):
        return json_path
    return model_path if has_model else None


def identity(directory):
    """What a run started from the transformers checkpoint `directory` records of it.

    Returns:
        dict: `directory` (absolute), `model_type`, and `files`: each of
        `config.json`, the tokenizer file and `tokenizer_config.json` by its
        SHA-256, and each weight file by its size and modification time
        (hashing gigabytes of weights at every start would cost minutes).
    """
    files = {}
    tokenizer = tokenizer_file(directory)
    for name in ("config.json", "tokenizer_config.json",
                 os.path.basename(tokenizer) if tokenizer else None):
        if name and os.path.isfile(os.path.join(directory, name)):
            files[name] = {"sha256": file_sha256(os.path.join(directory, name))}
    weights = [name for name in WEIGHT_FILES if os.path.exists(os.path.join(directory, name))][:1]
    if weights and weights[0].endswith(".index.json"):
        with open(os.path.join(directory, weights[0])) as file:
            weights += sorted(set(json.load(file)["weight_map"].values()))
    for name in weights:
        status = os.stat(os.path.join(directory, name))
        files[name] = {"bytes": status.st_size, "modified_ns": status.st_mtime_ns}
    return {"directory": os.path.abspath(directory), "model_type": model_type_of(directory),
            "files": files}
