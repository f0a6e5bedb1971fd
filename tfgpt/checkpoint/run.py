"""A run directory: its config.json and tokenizer, and the checkpoints every layout shares."""

import json
import os
import shutil

import tensorflow as tf

import tfgpt.checkpoint.files as files
from tfgpt.checkpoint.files import INDEX_FILE, Reader, latest
from tfgpt.checkpoint.state import model_entries
from tfgpt.parallel.local import LocalDistribution

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"


def read_config(directory):
    """Returns the resolved config saved beside a run's checkpoints."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}: not a tfgpt run directory")
    with open(path) as file:
        return json.load(file)


def write_run_files(directory, config, tokenizer_path=None):
    """Writes config.json (and copies the tokenizer) into the run directory."""
    os.makedirs(directory, exist_ok=True)
    files.write_json_atomically(os.path.join(directory, CONFIG_FILE), config)
    if tokenizer_path:
        # A SentencePiece model is always `tokenizer.model` in a run
        # directory; other tokenizers (a WordPiece vocab.txt) keep their name.
        name = os.path.basename(tokenizer_path)
        if name.endswith(".model"):
            name = TOKENIZER_FILE
        shutil.copyfile(tokenizer_path, os.path.join(directory, name))


def _input_prefix(path, index, count):
    """Where checkpoint `path` holds input pipeline `index` of `count`'s position."""
    return os.path.join(path, f"data-{index:05d}-of-{count:05d}")


class SaveFailed(RuntimeError):
    """A checkpoint could not be written on some rank; the previous one is still the latest."""


def layout_of(distribution):
    """`(coordinates, description)` of this rank in `distribution`: its
    (data, pipeline, tensor) coordinates, and what the index records of the
    layout (two layouts that record the same hold the same per-rank objects)."""
    state = distribution.state
    cut = None
    if state.pipelined:
        cut = [getattr(distribution.options, name)
               for name in ("virtual_stages", "pipeline_partition")]
    return state.coordinates(), {"ranks": state.size, "pipeline_cut": cut,
                                 "data_pipeline_tensor": [state.data, state.pipeline,
                                                          state.tensor]}


class RunCheckpointer:
    """Saves and restores a run's state in `directory`, whatever its layout.

    Every rank writes the parts it is the writer of and its per-rank
    objects; after a barrier the chief commits the index, so a crash
    mid-save leaves the previous checkpoint the latest. A write that fails
    on any rank (no space left, a read-only or vanished directory) raises
    `SaveFailed` on every rank, after the chief has removed the partial
    checkpoint. A restore reads,
    for each part this rank holds, the region it holds, from a checkpoint
    of any layout (`tfgpt.checkpoint.files.Reader`).

    Args:
        directory: str. The run's output directory.
        distribution: the run's distribution: `rank`, `is_chief`,
            `allreduce_mean` (the barrier) and its `layout`, read at every
            save (an elastic run's rank changes).
        entries: callable `()` -> this rank's `[Entry]`
            (`tfgpt.checkpoint.state.run_entries`).
        keep: int. Checkpoints kept (0: all).
        after_restore: callable `()` run after a restore (ZeRO gathers the
            weights of its shards), or None.
        base: `tfgpt.checkpoint.base.AdapterBase` of an adapter run, or None.
            Once it holds a reference, `entries` leaves the base weights out
            and the index names the base instead (`"base"`); a restore loads
            the base that the checkpoint names before the rest.
    """

    def __init__(self, directory, distribution, entries, keep=3, after_restore=None, base=None):
        self.directory = directory
        self.distribution = distribution
        self.entries = entries
        self.keep = keep
        self.after_restore = after_restore
        self.base = base
        self._input = None

    @property
    def latest(self):
        return latest(self.directory)

    def write_run_files(self, config, tokenizer_path=None):
        if self.distribution.is_chief:
            write_run_files(self.directory, config, tokenizer_path)

    def track_input(self, iterator, index=0, count=1):
        """Saves input pipeline `index` of `count`'s position (`iterator`, a
        checkpointable tf.data iterator; None stops) with each checkpoint.
        Its first rank writes it: the ranks of a tensor group and the stages
        of a pipeline share one."""
        self._input = None if iterator is None else (iterator, index, count)

    @staticmethod
    def restore_input(path, iterator, index, count):
        """Restores input pipeline `index` of `count`'s position into `iterator`
        from checkpoint `path`; False when it holds none (another number of them)."""
        prefix = _input_prefix(path, index, count)
        if not os.path.exists(prefix + ".index"):
            return False
        tf.train.Checkpoint(iterator=iterator).read(prefix).assert_existing_objects_matched()
        return True

    def save(self, step):
        """Writes the checkpoint of `step`; returns its path (None on other ranks)."""
        step = int(step)
        coordinates, layout = layout_of(self.distribution)
        rank = self.distribution.rank
        root = files.step_directory(self.directory, step)
        if self.distribution.is_chief and os.path.isdir(root):
            shutil.rmtree(root, ignore_errors=True)  # an earlier, interrupted save of this step
        self._agree(None, root)  # a barrier: nobody writes into what the chief removes
        written = [entry for entry in self.entries() if entry.writes]
        try:
            # One array in memory at a time: a copy of the state would double the peak.
            files.write_rank(self.directory, step, rank, (e.variable.numpy() for e in written),
                       [entry.record(rank, coordinates) for entry in written])
            if self._input is not None and tuple(coordinates[1:]) == (0, 0):
                iterator, index, count = self._input
                tf.train.Checkpoint(iterator=iterator).write(_input_prefix(root, index, count))
            error = None
        except (OSError, tf.errors.OpError) as failure:
            error = f"rank {rank}: {failure}"
        self._agree(error, root)  # every rank's files are on disk
        error = None
        meta = {"layout": layout}
        if self.base is not None and self.base.reference is not None:
            meta["base"] = self.base.reference
        if self.distribution.is_chief:
            try:
                files.commit(self.directory, step, layout["ranks"], meta, self.keep)
            except OSError as failure:
                error = f"the index, rank {rank}: {failure}"
        self._agree(error, root)  # the index too
        return root if self.distribution.is_chief else None

    def _agree(self, error, root):
        """A barrier that also counts the ranks whose `error` is not None;
        when there are any, removes the partial checkpoint `root` (the chief)
        and raises `SaveFailed` on every rank."""
        failed = float(self.distribution.allreduce_mean(tf.constant(float(error is not None))))
        if not failed:
            return
        if self.distribution.is_chief:
            shutil.rmtree(root, ignore_errors=True)
        ranks = round(failed * self.distribution.num_workers)
        raise SaveFailed(
            f"the checkpoint {root} could not be written ({error or 'on another rank'}; "
            f"{ranks} rank(s) failed); the latest checkpoint is still "
            f"{latest(self.directory) or 'none'}"
        )

    def restore_latest(self):
        """Restores the newest checkpoint into this rank's parts; returns its path or None."""
        path = self.latest
        if not path:
            return None
        coordinates, layout = layout_of(self.distribution)
        reader = Reader(path)
        try:
            if "base" in reader.index:  # the adapters alone: their base first
                if self.base is None:
                    raise ValueError(f"{path} holds adapters alone, and this run trains none "
                                     "(--lora-rank 0)")
                self.base.restore(reader.index["base"], path)
            same = reader.index["layout"] == layout
            for entry in self.entries():
                if entry.per_rank:
                    entry.variable.assign(reader.rank_object(entry.key, coordinates, same))
                    if not same and entry.seed_offset is not None:
                        entry.seed_offset.offset_seed(entry.variable)
                else:
                    entry.variable.assign(reader.part(entry.key, entry.shape, entry.split,
                                                      entry.tensor, entry.rows and entry.rows[:2]))
        finally:
            reader.close()
        if self.after_restore is not None:
            self.after_restore()
        return path


def load_parts(directory, entries):
    """Reads `entries` (`tfgpt.checkpoint.state.Entry`: what this rank holds,
    sliced and sharded as it holds it) from the latest checkpoint of the run
    `directory`, whatever layout wrote it; returns its path."""
    path = latest(directory)
    if path is None:
        raise FileNotFoundError(f"no checkpoint (ckpt-N/{INDEX_FILE}) in {directory}")
    reader = Reader(path)
    try:
        for entry in entries:
            entry.variable.assign(reader.part(entry.key, entry.shape, entry.split, entry.tensor,
                                              entry.rows and entry.rows[:2]))
    finally:
        reader.close()
    return path


def load_weights(directory, model, prefix=""):
    """Reads a whole `model`'s weights from the latest checkpoint of the run
    `directory` (any layout wrote it); returns its path.

    `prefix`: what the run's keys have before the model's own (an encoder
    restored from a model that holds it as `backbone/`).
    """
    return load_parts(directory, model_entries(model, prefix))


def save_weights(directory, model, step=0):
    """Writes a whole `model`'s weights as checkpoint `step` of `directory`, as a
    one-process run would (`load_weights` and `--init` read it)."""
    return RunCheckpointer(directory, LocalDistribution(), lambda: model_entries(model),
                           keep=0).save(step)
