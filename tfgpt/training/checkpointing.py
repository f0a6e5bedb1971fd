"""Checkpoints: model, optimizer and step, plus the resolved config as JSON."""

import json
import os
import shutil
import tempfile

import tensorflow as tf

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"


def write_json_atomically(path, data):
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as file:
        json.dump(data, file, indent=2, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(file.name, path)


def read_config(directory):
    """Returns the resolved config saved beside a run's checkpoints."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}: not a tfgpt run directory")
    with open(path) as file:
        return json.load(file)


class Checkpointer:
    """Saves and restores a run through `tf.train.CheckpointManager`.

    The manager writes a checkpoint's files first and updates its index
    last, so a crash mid-save leaves the previous checkpoint as the latest.
    Only the chief writes; every worker can restore.

    Args:
        directory: str. The run's output directory.
        is_chief: bool. Whether this worker writes.
        keep: int. Checkpoints kept.
        collective: bool. Every worker must take part in a save
            (tf.distribute multi-worker); non-chiefs write a scratch copy.
        rank: int. This worker's index, naming its scratch directory.
        restore_sharded: callable `(path)`, or None. Restores a checkpoint
            that a ZeRO run wrote (`tfgpt.training.sharded_checkpoint`)
            into these whole variables instead.
        **trackables: what to save (model, optimizer, step, ...).
    """

    def __init__(self, directory, is_chief, keep=3, collective=False, rank=0,
                 restore_sharded=None, **trackables):
        self.directory = directory
        self.restore_sharded = restore_sharded
        self.is_chief = is_chief
        self.collective = collective
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, directory, max_to_keep=keep, checkpoint_name="ckpt"
        )
        if collective and not is_chief:
            # tf.distribute's multi-worker saves need every worker; the
            # others write to a scratch directory that is deleted after.
            self._scratch = os.path.join(directory, f".worker-{rank}")
            self._scratch_manager = tf.train.CheckpointManager(
                self.checkpoint, self._scratch, max_to_keep=1, checkpoint_name="ckpt"
            )

    @property
    def latest(self):
        return self.manager.latest_checkpoint

    def write_run_files(self, config, tokenizer_path=None):
        """Writes config.json (and copies the tokenizer) into the run directory."""
        if not self.is_chief:
            return
        os.makedirs(self.directory, exist_ok=True)
        write_json_atomically(os.path.join(self.directory, CONFIG_FILE), config)
        if tokenizer_path:
            # A SentencePiece model is always `tokenizer.model` in a run
            # directory; other tokenizers (a WordPiece vocab.txt) keep their name.
            name = os.path.basename(tokenizer_path)
            if name.endswith(".model"):
                name = TOKENIZER_FILE
            shutil.copyfile(tokenizer_path, os.path.join(self.directory, name))

    def save(self, step):
        if self.is_chief:
            return self.manager.save(checkpoint_number=int(step))
        if self.collective:
            self._scratch_manager.save(checkpoint_number=int(step))
            shutil.rmtree(self._scratch, ignore_errors=True)
        return None

    def restore_latest(self):
        """Restores the newest checkpoint; returns its path or None."""
        path = self.latest
        if not path:
            return None
        from tfgpt.training.sharded_checkpoint import is_sharded
        from tfgpt.training.tensor_checkpoint import check_whole

        check_whole(self.directory, path)
        if is_sharded(path):
            if self.restore_sharded is None:
                raise ValueError(f"{path} was written by a --zero-stage run: its weights are in shards")
            self.restore_sharded(path)
        else:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        return path


class CheckpointerWrapper:
    """A distributed run's checkpoints: the chief's `Checkpointer` and each rank's parts.

    The chief's checkpoint holds the step and its index names the step
    last, so a checkpoint is complete once `latest` names it. Subclasses
    write `save(step)` (the ranks' parts, `barrier()`, then the chief's)
    and `restore_latest()`; `latest` and `write_run_files` are the chief's.

    Args:
        checkpointer: the chief's `Checkpointer` in the run directory.
        distribution: the run's `HorovodDistribution`.
    """

    def __init__(self, checkpointer, distribution):
        self.checkpointer = checkpointer
        self.directory = checkpointer.directory
        self.distribution = distribution

    @property
    def latest(self):
        return self.checkpointer.latest

    def write_run_files(self, config, tokenizer_path=None):
        self.checkpointer.write_run_files(config, tokenizer_path)

    def barrier(self):
        """Returns once every rank has called it (all their parts are on disk)."""
        self.distribution.allreduce_mean(tf.constant(0.0))

    def save(self, step):
        raise NotImplementedError

    def restore_latest(self):
        raise NotImplementedError
