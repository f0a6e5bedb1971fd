"""The frozen base of an adapter run: what its checkpoints leave out and name instead.

A run that trains low-rank adapters (`--lora-rank`) on the model of
`--init` changes none of that model's weights, so its checkpoints hold the
adapters, their optimizer state, the step and the data position alone; the
index names the base instead (`"base"`: the `--init` run, its checkpoint
and a fingerprint of the base weights). A resume and `tfgpt.loading`
read the base weights from there, after checking that the fingerprint is
still theirs: adapters trained on one base mean nothing on another.

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


def _digest(reader, keys):
    """The sha256 (hex) of the global tensors `keys` of the checkpoint `reader` reads."""
    digest = hashlib.sha256()
    for key in sorted(keys):
        value = np.ascontiguousarray(reader.whole(key))
        digest.update(f"{key}|{reader.entry(key)['dtype']}|{list(value.shape)}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def read_base(path, entries, keys):
    """Reads `entries` (`tfgpt.checkpoint.state.Entry`, the base weights this
    rank holds) from the checkpoint directory `path`; returns the fingerprint
    of the base: of the tensors `keys` (the whole model's base), whole."""
    reader = Reader(path)
    try:
        for entry in entries:
            entry.variable.assign(reader.part(entry.key, entry.shape, entry.split, entry.tensor,
                                              entry.rows and entry.rows[:2]))
        return _digest(reader, keys)
    finally:
        reader.close()


def whole_model_checkpoint(directory):
    """The latest checkpoint of the run `directory`, which `--init` reads a
    whole model from; raises in one line when there is none, or when it holds
    adapters alone."""
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
        if not os.path.exists(os.path.join(base, INDEX_FILE)):
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
