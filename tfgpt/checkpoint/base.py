"""The frozen base of an adapter run: what its checkpoints leave out and name instead.

A run that trains low-rank adapters (`--lora-rank`) on the model of
`--init` changes none of that model's weights, so its checkpoints hold the
adapters, their optimizer state, the step and the data position alone; the
index names the base instead (`"base"`: the `--init` run, its checkpoint
and a fingerprint of the base weights). A resume and `tfgpt.loading`
read the base weights from there, after checking that the fingerprint is
still theirs: adapters trained on one base mean nothing on another.

`--init` may also name a transformers decoder directory: it is read as a
checkpoint of the whole model (`open_checkpoint`), and is then the base's
"run" and "checkpoint" both.

The fingerprint is a sha256 over the base tensors as global tensors (key,
dtype, shape and bytes, keys in order), read from the base checkpoint, so
it does not depend on the layout that wrote the base nor on the one that
reads it: it covers the whole model's base, also on a pipeline rank that
holds one stage of it.
"""

import hashlib
import os

import numpy as np

from tfgpt.checkpoint.files import INDEX_FILE, Reader, latest
from tfgpt.hf_files import model_type_of


def _digest(reader, keys):
    """The sha256 (hex) of the global tensors `keys` of the checkpoint `reader` reads."""
    digest = hashlib.sha256()
    for key in sorted(keys):
        value = np.ascontiguousarray(reader.whole(key))
        digest.update(f"{key}|{reader.entry(key)['dtype']}|{list(value.shape)}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def open_checkpoint(path):
    """A `Reader` of the checkpoint directory `path`, or, when `path` is a
    transformers decoder directory, one of the whole model it holds
    (`tfgpt.convert_decoders.HFDecoderReader`)."""
    if model_type_of(path) is not None:
        from tfgpt.convert_decoders import HFDecoderReader  # (it imports the models)

        return HFDecoderReader(path)
    return Reader(path)


def read_base(path, entries, keys=None):
    """Reads `entries` (`tfgpt.checkpoint.state.Entry`, the base weights this
    rank holds) from the checkpoint `path` (`open_checkpoint`); returns the
    fingerprint of the base: of the tensors `keys` (the whole model's base),
    whole; None without `keys`."""
    reader = open_checkpoint(path)
    try:
        for entry in entries:
            entry.variable.assign(reader.part(entry.key, entry.shape, entry.split, entry.tensor,
                                              entry.rows and entry.rows[:2]))
        return _digest(reader, keys) if keys is not None else None
    finally:
        reader.close()


def whole_model_checkpoint(directory):
    """The latest checkpoint of the run `directory`, which `--init` reads a
    whole model from (a transformers decoder directory: itself); raises in
    one line when there is none, or when it holds adapters alone."""
    if model_type_of(directory) is not None:
        return directory
    path = latest(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint (ckpt-N/{INDEX_FILE}) in {directory}")
    reader = Reader(path)
    reader.close()
    if "base" in reader.index:
        raise ValueError(f"--init {directory} is an adapter run (its checkpoints hold the "
                         "adapters alone): fold them into their base first, "
                         f"`python -m tfgpt.convert merge {directory} DIR`, and start from DIR")
    return path


class AdapterBase:
    """The base weights of an adapter run and the reference its checkpoints hold.

    Args:
        entries: callable `()` -> `[Entry]` of the base weights this rank holds.
        keys: set of str. The keys of the whole model's base weights, which
            the fingerprint covers (`tfgpt.models.adapters.base_keys`).

    Attributes:
        reference: dict `{"run", "checkpoint", "sha256"}` once the base is
            loaded (`initialize_from` or `restore`), else None.
    """

    def __init__(self, entries, keys):
        self.entries = entries
        self.keys = keys
        self.reference = None

    def initialize_from(self, directory):
        """Loads the base from the latest checkpoint of the run `directory`
        (`--init`); returns that checkpoint's path."""
        path = whole_model_checkpoint(directory)
        sha = read_base(path, self.entries(), self.keys)
        self.reference = {"run": os.path.abspath(directory), "checkpoint": os.path.abspath(path),
                          "sha256": sha}
        return path

    def restore(self, reference, adapters):
        """Loads the base that `reference` (an adapter checkpoint's `"base"`) names,
        checking its fingerprint; `adapters`: that checkpoint's path, for the error.

        Raises ValueError in one line, naming both, when the base checkpoint is
        gone or holds other weights than the adapters were trained on.
        """
        base = reference["checkpoint"]
        if not (os.path.exists(os.path.join(base, INDEX_FILE)) or model_type_of(base)):
            raise ValueError(f"the adapters of {adapters} were trained on the base {base}, "
                             "which is missing: restore that checkpoint of "
                             f"{reference['run']} or merge the adapters where it exists")
        try:
            sha = read_base(base, self.entries(), self.keys)
        except ValueError as error:  # a key or a shape it lacks: another model
            raise ValueError(f"the adapters of {adapters} do not fit the base {base}: "
                             f"{error}") from None
        if sha != reference["sha256"]:
            raise ValueError(f"the adapters of {adapters} were trained on another base than "
                             f"{base} holds now (base weights sha256 {sha[:12]}, the adapters' "
                             f"{reference['sha256'][:12]}): adapters loaded onto another base")
        self.reference = dict(reference)
        return base
