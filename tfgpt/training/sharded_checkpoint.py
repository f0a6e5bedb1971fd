"""ZeRO checkpoints: every rank writes its own shards; any world size reads them.

A checkpoint of a `--zero-stage` 1-3 run at step S is, in the run
directory:

- `ckpt-S.*`, written by the chief through `tf.train.CheckpointManager`
  as at stage 0, with what every rank holds alike: the step, the dropout
  state and the optimizer's replicated variables (its iteration count, the
  float16 loss scale). Its index (`checkpoint`) is written last, so a
  checkpoint is complete once it names `ckpt-S`;
- `zero/ckpt-S/rank-R-of-N.npz`, one per rank: rank R's rows of every
  trainable variable (`param/I` for the I-th trainable variable) and of its
  optimizer moments (`momentum/I`, `velocity/I`), and `meta` (run id,
  step, rank, world size) as JSON bytes. Written to a temporary name and
  renamed, before the chief's `ckpt-S`;
- `zero/ckpt-S/layout.json`: the run id, the stage, the world size, and
  the path, shape and dtype of every trainable variable.

A variable's rows are split as `tfgpt.distributed.zero.shard_rows` splits
them for N ranks, so a reader with any other world size (or stage 0, or
`tfgpt.loading`) takes the rows it needs from the files that hold them.
Nothing is gathered on the chief to save.
"""

import json
import os
import secrets
import shutil
import zipfile

import numpy as np
import tensorflow as tf

from tfgpt.distributed.zero import SLOTS, shard_rows, slot_variables
from tfgpt.training.checkpointing import CheckpointerWrapper, write_json_atomically

SHARDS_DIRECTORY = "zero"
LAYOUT_FILE = "layout.json"


def shard_directory(directory, step):
    return os.path.join(directory, SHARDS_DIRECTORY, f"ckpt-{int(step)}")


def shard_file(directory, step, rank, size):
    return os.path.join(shard_directory(directory, step), f"rank-{rank:05d}-of-{size:05d}.npz")


def step_of(checkpoint_path):
    """The step number of a `.../ckpt-S` checkpoint prefix."""
    return int(checkpoint_path.rsplit("-", 1)[1])


def read_layout(directory, step):
    """The layout.json of the ZeRO checkpoint at `step`, or None for a stage 0 one."""
    path = os.path.join(shard_directory(directory, step), LAYOUT_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)


def replicated_optimizer_variables(optimizer):
    """The optimizer's variables that are not sharded: all but the moments."""
    slots = {id(v) for variables in slot_variables(optimizer).values() for v in variables}
    return [v for v in optimizer.variables if id(v) not in slots]


def _write_npz(path, entries):
    """Writes `(name, array)` pairs as an .npz, one array in memory at a time, atomically."""
    temporary = path + ".tmp"
    with zipfile.ZipFile(temporary, "w", allowZip64=True) as archive:
        for name, value in entries:
            with archive.open(name + ".npy", "w", force_zip64=True) as file:
                np.lib.format.write_array(file, np.asarray(value), allow_pickle=False)
    with open(temporary, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)


class ShardReader:
    """Reads any rows of a ZeRO checkpoint's variables and moments.

    Args:
        directory: str. The run directory.
        step: int. The checkpoint's step.

    Raises ValueError, naming the files, when the layout is missing, a
    rank's file is missing, or a file belongs to another run or step.

    Example:
    >>> reader = ShardReader("runs/zero", 200)
    >>> reader.rows("param", 0, 0, 10).shape  # the first 10 rows of the first variable
    """

    def __init__(self, directory, step):
        self.directory = directory
        self.step = step
        layout = read_layout(directory, step)
        if layout is None:
            raise ValueError(
                f"{shard_directory(directory, step)}/{LAYOUT_FILE} is missing: not a "
                "ZeRO checkpoint, or its shards were not all written"
            )
        self.layout = layout
        self.size = layout["world_size"]
        paths = [shard_file(directory, step, rank, self.size) for rank in range(self.size)]
        missing = [path for path in paths if not os.path.exists(path)]
        if missing:
            raise ValueError(
                f"the ZeRO checkpoint at step {step} of {directory} was written by "
                f"{self.size} ranks, but {len(missing)} shard file(s) are missing: "
                f"{', '.join(missing[:4])}"
            )
        self.files = []
        for rank, path in enumerate(paths):
            archive = np.load(path, allow_pickle=False)
            meta = json.loads(bytes(archive["meta"]).decode())
            expected = {"run_id": layout["run_id"], "step": step, "rank": rank, "size": self.size}
            if {name: meta.get(name) for name in expected} != expected:
                raise ValueError(
                    f"{path} does not belong to this checkpoint: it says {meta}, the layout "
                    f"{shard_directory(directory, step)}/{LAYOUT_FILE} expects {expected}"
                )
            self.files.append(archive)

    def rows(self, kind, index, start, stop):
        """Rows `[start, stop)` of `kind` (`param` or a slot) of variable `index`."""
        shape = self.layout["variables"][index]["shape"]
        counts, offsets = shard_rows(shape[0], self.size)
        parts = []
        for rank in range(self.size):
            low, high = max(start, offsets[rank]), min(stop, offsets[rank] + counts[rank])
            if low < high:
                part = self.files[rank][f"{kind}/{index}"]
                parts.append(part[low - offsets[rank]:high - offsets[rank]])
        if not parts:
            return np.zeros([0] + list(shape[1:]), self.layout["variables"][index]["dtype"])
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def whole(self, kind, index):
        return self.rows(kind, index, 0, self.layout["variables"][index]["shape"][0])

    def check_variables(self, variables, what):
        """Raises unless `variables` have the checkpoint's count and shapes."""
        saved = self.layout["variables"]
        if len(saved) != len(variables) or any(
            list(v.shape) != entry["shape"] for v, entry in zip(variables, saved)
        ):
            raise ValueError(
                f"the ZeRO checkpoint at step {self.step} of {self.directory} holds "
                f"{len(saved)} variables that do not match {what}'s {len(variables)} "
                f"(first saved: {saved[0]['path'] if saved else None} {saved[0]['shape'] if saved else ''})"
            )

    def close(self):
        for archive in self.files:
            archive.close()


class ShardedCheckpointer(CheckpointerWrapper):
    """Saves and restores a ZeRO run: the chief's `ckpt-S` and every rank's shards.

    Args:
        checkpointer: `tfgpt.training.checkpointing.Checkpointer` of the
            replicated state (step, dropout state, the optimizer's
            replicated variables) in the run directory.
        zero: `tfgpt.distributed.zero.ZeroSharding`.
        distribution: the run's `HorovodDistribution`.

    Same interface as `Checkpointer`: `latest`, `save(step)`,
    `restore_latest()`, `write_run_files(...)`.
    """

    def __init__(self, checkpointer, zero, distribution):
        super().__init__(checkpointer, distribution)
        self.is_chief = checkpointer.is_chief
        self.zero = zero
        # One id for the run, the same on every rank (rank 0's), kept on resume.
        hvd = distribution._hvd
        self.run_id = "%016x" % int(
            hvd.broadcast(tf.constant(secrets.randbits(62), tf.int64), root_rank=0).numpy()
        )

    def save(self, step):
        step = int(step)
        zero = self.zero
        os.makedirs(shard_directory(self.directory, step), exist_ok=True)
        meta = {"run_id": self.run_id, "step": step, "rank": zero.rank, "size": zero.size}

        def entries():
            yield "meta", np.frombuffer(json.dumps(meta).encode(), np.uint8)
            for index, shard in enumerate(zero.shards):
                yield f"param/{index}", shard.numpy()
                for name, slots in zero.slot_variables.items():
                    yield f"{name}/{index}", slots[index].numpy()

        _write_npz(shard_file(self.directory, step, zero.rank, zero.size), entries())
        self.barrier()  # every rank's shards are on disk before the chief's index names them
        if self.is_chief:
            write_json_atomically(
                os.path.join(shard_directory(self.directory, step), LAYOUT_FILE),
                {
                    "run_id": self.run_id,
                    "step": step,
                    "stage": zero.stage,
                    "world_size": zero.size,
                    "split": "dim 0; the first rows % world_size ranks hold one row more",
                    "slots": list(SLOTS),
                    "variables": [
                        {"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)}
                        for v in zero.variables
                    ],
                },
            )
        path = self.checkpointer.save(step)
        if self.is_chief:
            self._remove_stale_shards()
        return path

    def _remove_stale_shards(self):
        kept = {step_of(path) for path in self.checkpointer.manager.checkpoints}
        root = os.path.join(self.directory, SHARDS_DIRECTORY)
        for name in os.listdir(root):
            if name.startswith("ckpt-") and int(name.split("-")[1]) not in kept:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def restore_latest(self):
        """Restores the newest checkpoint, resharding it for this world size; returns its path."""
        path = self.latest
        if not path:
            return None
        zero = self.zero
        if not is_sharded(path) and not os.path.isdir(shard_directory(self.directory, step_of(path))):
            raise ValueError(
                f"{path} holds whole state (written with --zero-stage 0): resume it with "
                "--zero-stage 0; a --zero-stage 1-3 run resumes checkpoints of such runs"
            )
        reader = ShardReader(self.directory, step_of(path))
        try:
            reader.check_variables(zero.variables, "this model")
            rank = zero.rank
            values, slots = [], {name: [] for name in SLOTS}
            for index in range(len(zero.variables)):
                start = zero.offsets[index][rank]
                stop = start + zero.counts[index][rank]
                values.append(reader.rows("param", index, start, stop))
                for name in SLOTS:
                    slots[name].append(reader.rows(name, index, start, stop))
        finally:
            reader.close()
        self.checkpointer.checkpoint.restore(path).assert_existing_objects_matched()
        for name, variables in zero.slot_variables.items():
            for variable, value in zip(variables, slots[name]):
                variable.assign(value)
        zero.load_shards(values)
        self.run_id = reader.layout["run_id"]
        return path


def restore_whole(directory, path, variables, optimizer, checkpoint):
    """Restores a ZeRO checkpoint into whole (stage 0) variables and optimizer.

    Args:
        directory: str. The run directory.
        path: str. The `ckpt-S` prefix.
        variables: the model's trainable variables.
        optimizer: built on `variables`, or None to read the weights only.
        checkpoint: `tf.train.Checkpoint` of the replicated state (step,
            rng, optimizer_state), or None.
    """
    reader = ShardReader(directory, step_of(path))
    try:
        reader.check_variables(variables, "this model")
        for index, variable in enumerate(variables):
            variable.assign(reader.whole("param", index))
        if optimizer is not None:
            for name, slots in slot_variables(optimizer).items():
                for index, slot in enumerate(slots):
                    slot.assign(reader.whole(name, index))
    finally:
        reader.close()
    if checkpoint is not None:
        checkpoint.restore(path).assert_existing_objects_matched()


def is_sharded(path):
    """Whether the checkpoint `path` (a `.../ckpt-S` prefix) was written by a ZeRO run."""
    return read_layout(os.path.dirname(path), step_of(path)) is not None

