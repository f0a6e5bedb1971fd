"""tf.data input pipeline over a data directory written by `pipelines.prepare`.

Each record is a `tf.train.Example` whose int64 feature `input_ids` holds
`seq_len + 1` tokens; `make_dataset` yields `(inputs, targets)` batches with
`inputs = input_ids[:, :-1]` and `targets = input_ids[:, 1:]`, both int32 of
shape `(batch_size, seq_len)`.

Multi-worker input (Horovod rank/size, or a `tf.distribute.InputContext`):
records are split across workers before any shuffling. With at least as many
shard files as workers, worker `i` reads files `i, i + N, i + 2N, ...` of the
manifest's list (cheap: each worker opens only its files). With fewer files,
every worker reads all files in the same deterministic order and keeps records
`i, i + N, ...`. Either way the workers' records are disjoint and together
cover the split. Workers may then hold different numbers of records;
`steps_per_epoch` returns the number of full batches every worker can make.

Corrupted shards: TensorFlow's `DataLossError` ("corrupted record at 244")
does not say which file is broken, and tf.data has no way to catch and
re-raise an error inside a pipeline. So `make_dataset` checks, before
building the pipeline, that every shard exists and has the exact byte size the
manifest recorded (catches truncated, partially copied and appended-to files;
costs one `stat` per shard), and with `verify_checksums=True` also compares
SHA-256 digests (catches any corruption; costs one full read). Both raise
`DataError` naming the file. `verify_shards` runs the full check on its own.

Example:

>>> dataset = make_dataset("data/default", "train", batch_size=8)  # doctest: +SKIP
>>> inputs, targets = next(iter(dataset))  # doctest: +SKIP
>>> inputs.shape  # doctest: +SKIP
TensorShape([8, 128])
"""

import hashlib
import json
import os
from typing import List, Optional, Tuple

import tensorflow as tf

from pipelines.errors import DataError

MANIFEST_FILENAME = "manifest.json"
SUPPORTED_FORMAT_VERSIONS = (1,)
DEFAULT_SHUFFLE_BUFFER = 10_000


def load_manifest(data_dir: str) -> dict:
    """Read and check `manifest.json` of a data directory.

    Args:
        data_dir: str. A directory written by `python -m pipelines.prepare`.

    Returns:
        dict. The manifest (see `pipelines.prepare` for its keys).
    """
    path = os.path.join(data_dir, MANIFEST_FILENAME)
    if not tf.io.gfile.exists(path):
        raise DataError(
            f"no {MANIFEST_FILENAME} in {data_dir} — run python -m pipelines.prepare first"
        )
    try:
        with tf.io.gfile.GFile(path, "r") as manifest_file:
            manifest = json.load(manifest_file)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error})") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise DataError(
            f"{path}: unsupported format_version {version!r}; this reader supports "
            f"{list(SUPPORTED_FORMAT_VERSIONS)}"
        )
    return manifest


def _split_shards(manifest: dict, split: str, data_dir: str) -> List[dict]:
    splits = manifest["splits"]
    if split not in splits:
        raise ValueError(f"`split` must be one of {sorted(splits)}. Received: split={split!r}")
    shards = splits[split]["shards"]
    if not shards:
        raise DataError(
            f"{os.path.join(data_dir, MANIFEST_FILENAME)}: split {split!r} has no shards "
            f"(prepared with val_fraction={manifest.get('val_fraction')})"
        )
    return shards


def _validate_workers(num_workers: int, worker_index: int) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(
            f"`num_shards` must be a positive int. Received: num_shards={num_workers!r}"
        )
    if (
        isinstance(worker_index, bool)
        or not isinstance(worker_index, int)
        or not 0 <= worker_index < num_workers
    ):
        raise ValueError(
            "`shard_index` must be an int in [0, num_shards). "
            f"Received: shard_index={worker_index!r}, num_shards={num_workers}"
        )


def _validate_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}"
        )


def worker_shards(
    shards: List[dict], num_workers: int, worker_index: int
) -> Tuple[List[dict], bool]:
    """Decide which shard files one worker reads, and whether to split records.

    Args:
        shards: list of dict. The split's shard entries, in manifest order.
        num_workers: int.
        worker_index: int.

    Returns:
        (list of dict, bool). The worker's shard entries, and True when there
        are fewer files than workers so records (not files) are divided.
    """
    if len(shards) >= num_workers:
        return shards[worker_index::num_workers], False
    return list(shards), True


def records_per_worker(manifest: dict, split: str, num_workers: int) -> List[int]:
    """Number of records each worker reads in one epoch, under `make_dataset`'s rule.

    Args:
        manifest: dict. From `load_manifest`.
        split: str. "train" or "val".
        num_workers: int.

    Returns:
        list of int, one per worker.
    """
    _validate_workers(num_workers, 0)
    shards = _split_shards(manifest, split, "<data_dir>")
    counts = []
    for worker_index in range(num_workers):
        files, by_record = worker_shards(shards, num_workers, worker_index)
        total = sum(shard["sequences"] for shard in files)
        if by_record:
            # Records worker_index, worker_index + N, ... of `total`.
            total = max(0, (total - worker_index + num_workers - 1) // num_workers)
        counts.append(total)
    return counts


def steps_per_epoch(data_dir: str, split: str, batch_size: int, num_workers: int = 1) -> int:
    """Full batches per epoch that every worker can make (the minimum over workers).

    All workers must run the same number of steps (a collective allreduce
    waits for every rank), so a trainer runs this many steps per epoch.

    Args:
        data_dir: str. A prepared data directory.
        split: str. "train" or "val".
        batch_size: int. Per-worker batch size.
        num_workers: int. Number of input pipelines (Horovod size).

    Returns:
        int. At least 1.
    """
    _validate_batch_size(batch_size)
    counts = records_per_worker(load_manifest(data_dir), split, num_workers)
    steps = min(counts) // batch_size
    if steps < 1:
        raise DataError(
            f"{data_dir}: split {split!r} gives some worker only {min(counts)} record(s) "
            f"with num_workers={num_workers}, fewer than batch_size={batch_size}"
        )
    return steps


def _check_shard_files(data_dir: str, shards: List[dict], verify_checksums: bool) -> None:
    """Raise DataError naming the first missing, resized or (optionally) altered shard."""
    for shard in shards:
        path = os.path.join(data_dir, shard["filename"])
        if not tf.io.gfile.exists(path):
            raise DataError(f"{path}: shard listed in {MANIFEST_FILENAME} is missing")
        size = tf.io.gfile.stat(path).length
        if size != shard["bytes"]:
            raise DataError(
                f"{path}: shard is corrupted or truncated: {size} bytes on disk, "
                f"{shard['bytes']} in {MANIFEST_FILENAME}"
            )
    if verify_checksums:
        for shard in shards:
            path = os.path.join(data_dir, shard["filename"])
            digest = hashlib.sha256()
            with tf.io.gfile.GFile(path, "rb") as shard_file:
                while True:
                    chunk = shard_file.read(8 << 20)
                    if not chunk:
                        break
                    digest.update(chunk)
            if digest.hexdigest() != shard["sha256"]:
                raise DataError(
                    f"{path}: shard is corrupted: sha256 {digest.hexdigest()} does not "
                    f"match {shard['sha256']} in {MANIFEST_FILENAME}"
                )


def verify_shards(data_dir: str, split: Optional[str] = None) -> None:
    """Check every shard's presence, size and SHA-256 against the manifest.

    Run it when training stops with a `DataLossError` to find the broken file.

    Args:
        data_dir: str. A prepared data directory.
        split: str or None. One split, or None for all splits with shards.
    """
    manifest = load_manifest(data_dir)
    splits = (
        [split]
        if split is not None
        else [name for name, summary in manifest["splits"].items() if summary["shards"]]
    )
    for name in splits:
        _check_shard_files(data_dir, _split_shards(manifest, name, data_dir), True)


def make_dataset(
    data_dir: str,
    split: str,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    repeat: bool = True,
    num_shards: int = 1,
    shard_index: int = 0,
    input_context: Optional[tf.distribute.InputContext] = None,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
    deterministic: bool = False,
    verify_checksums: bool = False,
) -> tf.data.Dataset:
    """Build the `(inputs, targets)` pipeline for one worker.

    Args:
        data_dir: str. A directory written by `python -m pipelines.prepare`.
        split: str. "train" or "val".
        batch_size: int. Per-worker batch size (with `input_context`, pass
            `input_context.get_per_replica_batch_size(global_batch_size)`).
            Partial batches are dropped so every batch has a static shape.
        shuffle: bool. Shuffle file order (reshuffled each epoch) and records
            (through a buffer of `shuffle_buffer` records).
        seed: int. Seed of both shuffles; the same on all workers.
        repeat: bool. Repeat forever; otherwise one epoch.
        num_shards: int. Number of workers (e.g. `hvd.size()`).
        shard_index: int. This worker's index (e.g. `hvd.rank()`).
        input_context: tf.distribute.InputContext or None. When given, its
            `num_input_pipelines` and `input_pipeline_id` replace `num_shards`
            and `shard_index`.
        shuffle_buffer: int. Records held by the record shuffle.
        deterministic: bool. Keep element order reproducible at some cost in
            throughput. Forced on internally where record-level sharding needs
            it for disjointness.
        verify_checksums: bool. Also hash this worker's shards and compare with
            the manifest before reading (a full read of the files).

    Returns:
        tf.data.Dataset of `(inputs, targets)`, int32, each of shape
        `(batch_size, seq_len)`.
    """
    if input_context is not None:
        num_shards = input_context.num_input_pipelines
        shard_index = input_context.input_pipeline_id
    _validate_workers(num_shards, shard_index)
    _validate_batch_size(batch_size)
    if (
        isinstance(shuffle_buffer, bool)
        or not isinstance(shuffle_buffer, int)
        or shuffle_buffer < 1
    ):
        raise ValueError(
            f"`shuffle_buffer` must be a positive int. Received: shuffle_buffer={shuffle_buffer!r}"
        )

    manifest = load_manifest(data_dir)
    shards = _split_shards(manifest, split, data_dir)
    # Every listed file must be there (any worker finding a hole reports it);
    # checksums only for the files this worker will actually read.
    _check_shard_files(data_dir, shards, verify_checksums=False)
    files, by_record = worker_shards(shards, num_shards, shard_index)
    if verify_checksums:
        _check_shard_files(data_dir, files, verify_checksums=True)
    paths = [os.path.join(data_dir, shard["filename"]) for shard in files]
    record_length = manifest["record_length"]
    feature_name = manifest["feature"]

    dataset = tf.data.Dataset.from_tensor_slices(paths)
    if shuffle:
        # Same seed on every worker: with record-level sharding all workers must
        # walk the files in the same order for `shard` to give disjoint records.
        dataset = dataset.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(len(paths), 16),
        num_parallel_calls=tf.data.AUTOTUNE,
        # Record sharding needs the same record order on every worker.
        deterministic=deterministic or by_record,
    )
    if by_record:
        dataset = dataset.shard(num_shards, shard_index)
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        dataset = dataset.repeat()
    dataset = dataset.batch(batch_size, drop_remainder=True)

    features = {feature_name: tf.io.FixedLenFeature([record_length], tf.int64)}

    def split_inputs_and_targets(serialized):
        token_ids = tf.io.parse_example(serialized, features)[feature_name]
        token_ids = tf.cast(token_ids, tf.int32)  # (B, T + 1)
        return token_ids[:, :-1], token_ids[:, 1:]  # (B, T), (B, T)

    dataset = dataset.map(
        split_inputs_and_targets,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=deterministic,
    )
    return dataset.prefetch(tf.data.AUTOTUNE)
