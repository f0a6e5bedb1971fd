"""The checkpoint on disk: each rank's chunks, one index, committed last.

A checkpoint of a run at step S is the directory `OUT/ckpt-S/`:

- `rank-R.npz`: the arrays rank R writes, one per chunk (`c0`, `c1`, ...),
  and `rank-R.json`: what each of them is. A chunk is a region of one
  global tensor, named by its key (the variable's path in the whole model,
  `tfgpt.checkpoint.state`): the slice `index` of `T` that tensor
  parallelism cuts along `axis` (in `groups` interleaved parts, as the fused
  query/key/value is cut; `tfgpt.parallel.tensor_parallel.take_slice`),
  or the whole tensor, then rows `[start, stop)` of that slice (a ZeRO
  shard) or all of them. A per-rank object (a dropout generator's state,
  which cannot be resliced) is a chunk tied to its rank's coordinates;
- `data-I-of-N.*`: input pipeline I's position (a `tf.train.Checkpoint`
  of its iterator);
- `index.json`, written by the chief once every rank's files are on disk
  (after a barrier): the layout that wrote it and every chunk of every
  key. A directory without it is an interrupted save: `latest` skips it.

Any layout reads what it needs (`Reader.part`): the chunk it wrote itself
when the layouts match, else the global tensor assembled from the chunks
that cover it, then cut as the reading rank holds it.
"""

import json
import os
import re
import secrets
import shutil
import tempfile
import zipfile

import numpy as np
import tensorflow as tf

from tfgpt.parallel.tensor_parallel import join_slices, take_slice

INDEX_FILE = "index.json"
FORMAT = "tfgpt-chunks/1"
_STEP = re.compile(r"^ckpt-(\d+)$")


def write_json_atomically(path, data):
    """Writes `data` as JSON to `path` through a temporary file and a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as file:
        json.dump(data, file, indent=2, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(file.name, path)


def step_directory(directory, step):
    return os.path.join(directory, f"ckpt-{int(step)}")


def _steps(directory):
    """`{step: complete}` of the `ckpt-S` directories in `directory`."""
    found = {}
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = _STEP.match(name)
            if match and os.path.isdir(os.path.join(directory, name)):
                found[int(match.group(1))] = os.path.exists(
                    os.path.join(directory, name, INDEX_FILE))
    return found


def check_format(directory):
    """Raises, in one line, for a run directory with checkpoints of an earlier tfgpt."""
    earlier = os.path.exists(os.path.join(directory, "checkpoint"))
    if earlier and not any(_steps(directory).values()):
        raise ValueError(
            f"{directory} holds TensorFlow checkpoint files (ckpt-N.index) of an earlier tfgpt, "
            "not chunked checkpoints (ckpt-N/index.json): this version does not read them; "
            "train it again, or load its weights with the version that wrote it and save them "
            "with tfgpt.loading.save_model")


def latest(directory):
    """The newest complete checkpoint directory in `directory`, or None."""
    check_format(directory)
    complete = [step for step, done in _steps(directory).items() if done]
    return step_directory(directory, max(complete)) if complete else None


def write_rank(directory, step, rank, arrays, records):
    """Writes rank `rank`'s `arrays` (ndarrays, an iterable read once) and their `records`
    (`[dict]`) at `step`.

    The .npz streams one array at a time and carries a random stamp that
    the index records, so a file of another save is recognised; both files
    are renamed into place.
    """
    root = step_directory(directory, step)
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"rank-{rank:05d}.npz")
    stamp = secrets.token_hex(8)
    with zipfile.ZipFile(path + ".tmp", "w", allowZip64=True) as archive:
        with archive.open("stamp.npy", "w") as file:
            np.lib.format.write_array(file, np.frombuffer(stamp.encode(), np.uint8))
        for index, array in enumerate(arrays):
            array = np.asarray(array)
            if array.dtype.kind == "V":  # bfloat16 and other ml_dtypes: their bits
                array = array.view(f"u{array.dtype.itemsize}")
            with archive.open(f"c{index}.npy", "w", force_zip64=True) as file:
                np.lib.format.write_array(file, array, allow_pickle=False)
    with open(path + ".tmp", "rb+") as file:
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)
    write_json_atomically(os.path.join(root, f"rank-{rank:05d}.json"),
                          {"stamp": stamp, "chunks": records})


def commit(directory, step, ranks, meta, keep):
    """The chief's last word on a save: the index of `ranks` ranks' chunks, then pruning.

    Call once every rank's `write_rank` returned (a barrier). Keeps the
    newest `keep` checkpoints and removes interrupted saves older than this one.
    """
    root = step_directory(directory, step)
    keys, stamps = {}, {}
    for rank in range(ranks):
        with open(os.path.join(root, f"rank-{rank:05d}.json")) as file:
            written = json.load(file)
        stamps[f"rank-{rank:05d}.npz"] = written["stamp"]
        for position, record in enumerate(written["chunks"]):
            key, shape, dtype = record.pop("key"), record.pop("shape"), record.pop("dtype")
            entry = keys.setdefault(key, {"shape": shape, "dtype": dtype, "chunks": []})
            if entry["shape"] != shape:
                raise ValueError(f"rank {rank} saved {key!r} as {shape}, another rank as "
                                 f"{entry['shape']}: the ranks do not hold one model")
            entry["chunks"].append(dict(record, file=f"rank-{rank:05d}.npz", name=f"c{position}"))
    write_json_atomically(os.path.join(root, INDEX_FILE),
                          dict(meta, format=FORMAT, step=int(step), files=stamps, keys=keys))
    steps = _steps(directory)
    kept = sorted(s for s, done in steps.items() if done)[-keep:] if keep else list(steps)
    for old, done in steps.items():
        if old < step and (old not in kept or not done):
            shutil.rmtree(step_directory(directory, old), ignore_errors=True)


def region(value, split=None, tensor=None, rows=None):
    """The part of the global tensor `value` a rank holds (`Reader.part`'s arguments)."""
    if tensor is not None and tensor[0] > 1:
        value = take_slice(value, split, *tensor)
    return value[rows[0]:rows[1]] if rows is not None else value


class Reader:
    """Reads the parts any layout needs from the checkpoint directory `path`.

    Raises ValueError in one line for a directory without an index, of
    another format, or with a chunk file missing.

    Example:
    >>> reader = Reader("runs/demo/ckpt-200")
    >>> reader.part("block_0/attention/query_key_value/kernel").shape
    (64, 192)
    """

    def __init__(self, path):
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if not os.path.exists(index):
            raise ValueError(f"{path} has no {INDEX_FILE}: its save did not finish")
        with open(index) as file:
            self.index = json.load(file)
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index} is not a {FORMAT} checkpoint index "
                             f"(format {self.index.get('format')!r})")
        self.keys = self.index["keys"]
        missing = [name for name in sorted(self.index["files"])
                   if not os.path.exists(os.path.join(path, name))]
        if missing:
            raise ValueError(f"{path} is incomplete: its index names {len(missing)} chunk "
                             f"file(s) that are missing: {', '.join(missing[:4])}")
        self._open = {}

    def array(self, chunk, dtype):
        """The array of one `chunk` of the index, as `dtype`."""
        if chunk["file"] not in self._open:
            archive = np.load(os.path.join(self.path, chunk["file"]), allow_pickle=False)
            if bytes(archive["stamp"]).decode() != self.index["files"][chunk["file"]]:
                archive.close()
                raise ValueError(f"{os.path.join(self.path, chunk['file'])} does not belong to "
                                 "this checkpoint: another save wrote it")
            self._open[chunk["file"]] = archive
        array = self._open[chunk["file"]][chunk["name"]]
        wanted = tf.dtypes.as_dtype(dtype).as_numpy_dtype
        return array.view(wanted) if np.dtype(wanted).kind == "V" else array

    def entry(self, key, shape=None):
        """The index entry of `key`; raises in one line if it is missing or has another shape."""
        entry = self.keys.get(key)
        if entry is None:
            raise ValueError(f"{self.path} holds no {key!r}: it is another model's checkpoint, "
                             "or another task's")
        if shape is not None and list(shape) != entry["shape"]:
            raise ValueError(f"{self.path} holds {key!r} with shape {tuple(entry['shape'])}; this "
                             f"model's is {tuple(shape)}: another model's checkpoint")
        return entry

    def whole(self, key):
        """The global tensor `key`, joined from its chunks."""
        entry = self.entry(key)
        slices = {}
        for chunk in entry["chunks"]:
            if chunk.get("rank") is None:
                slices.setdefault(tuple(chunk["tensor"] or (1, 0))[1], []).append(chunk)
        if not slices:
            raise ValueError(f"{self.path} holds {key!r} per rank only")
        first = slices[min(slices)][0]
        if sorted(slices) != list(range(first["tensor"][0] if first["tensor"] else 1)):
            raise ValueError(f"{self.path} lacks tensor slices of {key!r}: has {sorted(slices)}")
        parts = [self._rows(key, entry, slices[index]) for index in sorted(slices)]
        whole = join_slices(parts, first["split"]) if first["tensor"] else parts[0]
        if list(whole.shape) != entry["shape"]:
            raise ValueError(f"{self.path}: the chunks of {key!r} join to {whole.shape}, "
                             f"not {tuple(entry['shape'])}")
        return whole

    def _rows(self, key, entry, chunks):
        """One tensor slice of `key` from its row chunks, which must cover it."""
        chunks = sorted(chunks, key=lambda chunk: (chunk["rows"] or [0])[0])
        if chunks[0]["rows"] is None:
            return self.array(chunks[0], entry["dtype"])
        parts, end = [], 0
        for chunk in chunks:
            start, stop, _ = chunk["rows"]
            if start != end:
                raise ValueError(f"{self.path} lacks rows {end}-{start} of {key!r}")
            parts.append(self.array(chunk, entry["dtype"]))
            end = stop
        if end != chunks[0]["rows"][2]:
            raise ValueError(f"{self.path} lacks rows {end}-{chunks[0]['rows'][2]} of {key!r}")
        return np.concatenate(parts)

    def part(self, key, shape=None, split=None, tensor=None, rows=None):
        """The region of `key` a rank holds: tensor slice `tensor` = `(T, index)`
        under `split` = `(axis, groups)` (None: whole), then `rows` = `(start, stop)`."""
        entry = self.entry(key, shape)
        for chunk in entry["chunks"]:  # the same region, as written: no assembly
            if chunk.get("rank") is None and (  # (1, 0) and None: the whole tensor
                    tuple(chunk["tensor"] or (1, 0)) == tuple(tensor or (1, 0))) and (
                    (chunk["rows"] or [None, None])[:2] == list(rows or [None, None])):
                return self.array(chunk, entry["dtype"])
        return region(self.whole(key), split, tensor, rows)

    def rank_object(self, key, coordinates, same_layout):
        """A per-rank object: this rank's own when `same_layout`, else the first
        tensor slice's copy (from the lowest rank that wrote one)."""
        entry = self.entry(key)
        chunks = [chunk for chunk in entry["chunks"] if chunk.get("rank") is not None]
        if same_layout:
            mine = [c for c in chunks if c["coordinates"] == list(coordinates)]
            if mine:
                return self.array(mine[0], entry["dtype"])
        first = sorted((c for c in chunks if c["coordinates"][2] == 0), key=lambda c: c["rank"])
        if not first:
            raise ValueError(f"{self.path} holds no copy of {key!r} from a first tensor slice")
        return self.array(first[0], entry["dtype"])

    def close(self):
        for archive in self._open.values():
            archive.close()
        self._open = {}
