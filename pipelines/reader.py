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

Equal steps: a worker that runs out of batches first would leave the others
waiting forever in the next allreduce. With `equal_steps=True` (the default
when `repeat=True` and every worker can make a batch) every worker's epoch
is cut to the same `steps_per_epoch * batch_size` records, taken after the
record shuffle, so a different surplus is left out each epoch and epochs
stay aligned across workers. With `repeat=False` the default is one full pass over this worker's
records (evaluation loops that sum and allreduce once at the end); pass
`equal_steps=True` when each step has a collective.

Global order (elastic training): with `cursor=P`, every worker builds the
same stream of the split's records, epoch after epoch (`global_records`:
files in one seeded order, read one after the other, records shuffled in
seeded blocks, new draws each epoch), skips the first P and keeps every
N-th from its index on. N workers that each take B records per step in lockstep
consume positions P to P + s * B * N - 1 in s steps, whatever N was before:
a run whose world size changes restarts every worker's pipeline at the
cursor its steps reached, and each sequence of an epoch is used once.

Exact resume: every pipeline here is made of checkpointable tf.data
transformations only (no `py_function`; shuffle buffers hold at most
`shuffle_buffer` serialized records), so `tf.train.Checkpoint(iterator=
iter(dataset))` saves the position, the shuffle buffers and the random state;
restoring it into a fresh iterator over a freshly built identical dataset
continues with the next unseen batch. With `deterministic=True` those
batches are exactly the ones an uninterrupted iterator would have produced;
with `deterministic=False` the parallel interleave may change the order,
but no record of the epoch is repeated or lost.

Corrupted shards: TensorFlow's `DataLossError` ("corrupted record at 244")
does not say which file is broken, and tf.data has no way to catch and
re-raise an error inside a pipeline. So `make_dataset` checks, before
building the pipeline, that every shard exists and has the exact byte size the
manifest recorded (catches truncated, partially copied and appended-to files;
costs one `stat` per shard), and with `verify_checksums=True` also compares
SHA-256 digests (catches any corruption; costs one full read). Both raise
`DataError` naming the file. `verify_shards` runs the full check on its own
and names the first unreadable record (call it on a `DataLossError`, as
`tfgpt.training.trainer` does). With `skip_corrupt=True` a worker checks
its shards' checksums first, leaves out the corrupted ones with a
`CorruptShardWarning` that counts them and their records, and (with equal
steps) fills its epoch from its intact shards so every worker still runs the
same number of steps.

Compression: GZIP shards (`prepare --compression gzip`) are read with
`compression_type="GZIP"`, taken from the manifest.

Example:

>>> dataset = make_dataset("data/default", "train", batch_size=8)  # doctest: +SKIP
>>> inputs, targets = next(iter(dataset))  # doctest: +SKIP
>>> inputs.shape  # doctest: +SKIP
TensorShape([8, 128])
"""

import json
import os
import warnings
from typing import List, Optional, Tuple

import tensorflow as tf

from pipelines.errors import DataError
from pipelines.files import file_sha256
from pipelines.manifest import (
    ENCODER_FORMAT,
    MANIFEST_FILENAME,
    PACKED_FORMAT,
    SUPPORTED_FORMAT_VERSIONS,
    Manifest,
    Shard,
)

DEFAULT_SHUFFLE_BUFFER = 10_000


class CorruptShardWarning(UserWarning):
    """Shards left out by `skip_corrupt=True`; the message counts them and their records."""


def load_manifest(data_dir: str) -> Manifest:
    """Read and check `manifest.json` of a data directory.

    Args:
        data_dir: str. A directory written by `python -m pipelines.prepare`.

    Returns:
        dict. The manifest (`pipelines.manifest.Manifest` describes its keys).
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


def _split_shards(manifest: Manifest, split: str, data_dir: str) -> List[Shard]:
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_int(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")


def _validate_workers(num_workers: int, worker_index: int) -> None:
    _check_positive_int("num_shards", num_workers)
    if not _is_int(worker_index) or not 0 <= worker_index < num_workers:
        raise ValueError(
            "`shard_index` must be an int in [0, num_shards). "
            f"Received: shard_index={worker_index!r}, num_shards={num_workers}"
        )


def worker_shards(
    shards: List[Shard], num_workers: int, worker_index: int
) -> Tuple[List[Shard], bool]:
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


def records_per_worker(manifest: Manifest, split: str, num_workers: int) -> List[int]:
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
    _check_positive_int("batch_size", batch_size)
    counts = records_per_worker(load_manifest(data_dir), split, num_workers)
    steps = min(counts) // batch_size
    if steps < 1:
        raise DataError(
            f"{data_dir}: split {split!r} gives some worker only {min(counts)} record(s) "
            f"with num_workers={num_workers}, fewer than batch_size={batch_size}"
        )
    return steps


def first_unreadable_record(path: str, compression: Optional[str] = None) -> str:
    """Describe where TFRecord reading of `path` first fails, e.g. "record 17".

    Returns:
        str. "record N (...error...)" with N counted from 0, or "no unreadable
        record" if every record reads (the damage is elsewhere, e.g. extra
        bytes at the end).
    """
    count = 0
    try:
        for _ in tf.data.TFRecordDataset(path, compression_type=compression or ""):
            count += 1
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as error:
        reason = error.message.strip().splitlines()[0] if error.message else type(error).__name__
        return f"record {count} ({reason})"
    return f"no unreadable record among {count}"


def _sha256(path: str) -> str:
    return file_sha256(path, open_file=tf.io.gfile.GFile)


def _check_shard_files(
    data_dir: str,
    shards: List[Shard],
    verify_checksums: bool,
    compression: Optional[str] = None,
    locate_records: bool = False,
) -> None:
    """Raise DataError naming the first missing, resized or (optionally) altered shard."""

    def where(path):
        if not locate_records:
            return ""
        return f"; reading fails at {first_unreadable_record(path, compression)}"

    for shard in shards:
        path = os.path.join(data_dir, shard["filename"])
        if not tf.io.gfile.exists(path):
            raise DataError(f"{path}: shard listed in {MANIFEST_FILENAME} is missing")
        size = tf.io.gfile.stat(path).length
        if size != shard["bytes"]:
            raise DataError(
                f"{path}: shard is corrupted or truncated: {size} bytes on disk, "
                f"{shard['bytes']} in {MANIFEST_FILENAME}{where(path)}"
            )
    if verify_checksums:
        for shard in shards:
            path = os.path.join(data_dir, shard["filename"])
            digest = _sha256(path)
            if digest != shard["sha256"]:
                raise DataError(
                    f"{path}: shard is corrupted: sha256 {digest} does not "
                    f"match {shard['sha256']} in {MANIFEST_FILENAME}{where(path)}"
                )


def verify_shards(data_dir: str, split: Optional[str] = None) -> None:
    """Check every shard's presence, size and SHA-256 against the manifest.

    Run it when training stops with a `DataLossError` to find the broken
    file: the `DataError` names it and the first record that cannot be read.

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
        _check_shard_files(
            data_dir,
            _split_shards(manifest, name, data_dir),
            True,
            manifest.get("compression"),
            locate_records=True,
        )


def _validate_common(num_shards, shard_index, batch_size, shuffle_buffer) -> None:
    _validate_workers(num_shards, shard_index)
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("shuffle_buffer", shuffle_buffer)


def _check_format(manifest: Manifest, data_dir: str, expected: str, function: str) -> None:
    found = manifest.get("format", PACKED_FORMAT)
    if found != expected:
        hint = (
            "pipelines.encoder_data.make_encoder_dataset"
            if found == ENCODER_FORMAT
            else "pipelines.reader.make_dataset"
        )
        raise DataError(
            f"{os.path.join(data_dir, MANIFEST_FILENAME)}: holds {found!r} records, "
            f"{function} reads {expected!r} records (use {hint})"
        )


def open_data_dir(
    data_dir: str,
    data_format: str,
    function: str,
    *,
    batch_size: int,
    num_shards: int,
    shard_index: int,
    input_context: Optional[tf.distribute.InputContext],
    shuffle_buffer: int,
) -> Tuple[Manifest, int, int]:
    """Check a reader's arguments and the directory's format; the part every reader shares.

    Args:
        data_dir: str. A prepared data directory.
        data_format: str. The `format` the reader reads (`PACKED_FORMAT` or
            `ENCODER_FORMAT`).
        function: str. The reader's name, for the error message.
        batch_size, num_shards, shard_index, input_context, shuffle_buffer:
            as for `make_dataset`.

    Returns:
        (manifest, num_shards, shard_index), the last two from
        `input_context` when it is given.
    """
    if input_context is not None:
        num_shards = input_context.num_input_pipelines
        shard_index = input_context.input_pipeline_id
    _validate_common(num_shards, shard_index, batch_size, shuffle_buffer)
    manifest = load_manifest(data_dir)
    _check_format(manifest, data_dir, data_format, function)
    return manifest, num_shards, shard_index


def global_records(
    manifest: Manifest,
    data_dir: str,
    split: str,
    *,
    shuffle: bool,
    seed: int,
    shuffle_buffer: int,
    cursor: int,
) -> tf.data.Dataset:
    """The split's records, epoch after epoch, in one order every worker builds alike; from `cursor` on.

    Epoch `e` reads every shard once, in the manifest's order or (with
    `shuffle`) in an order drawn from `(seed, e)`, record after record,
    and shuffles each block of `shuffle_buffer` consecutive records with
    a seed drawn from `(seed, e, block)`; positions `e * R` to
    `(e + 1) * R - 1` of the stream are epoch `e`'s `R` records. Every
    draw is stateless, so any worker can start at any epoch. Starting at
    `cursor` skips whole epochs without reading them and reads through
    the rest of the cursor's epoch (`skip`), O(R) records at most.

    Args:
        manifest, data_dir, split, shuffle, seed, shuffle_buffer: as for
            `make_dataset`.
        cursor: int. Records of the stream already consumed.

    Returns:
        tf.data.Dataset of scalar tf.string records, endless.
    """
    if not _is_int(cursor) or cursor < 0:
        raise ValueError(f"`cursor` must be a non-negative int. Received: cursor={cursor!r}")
    shards = _split_shards(manifest, split, data_dir)
    compression = manifest.get("compression") or ""
    records_per_epoch = sum(shard["sequences"] for shard in shards)
    paths = tf.constant([os.path.join(data_dir, shard["filename"]) for shard in shards])
    first_epoch, offset = divmod(cursor, records_per_epoch)

    # Stateless draws (`Dataset.shuffle` takes no tensor seed once a
    # global seed is set): the same on every worker, from any epoch on.
    def epoch_records(epoch):
        epoch_seed = tf.random.experimental.stateless_fold_in(
            tf.constant([seed, 0], tf.int64), epoch
        )
        order = tf.random.experimental.stateless_shuffle(paths, epoch_seed) if shuffle else paths
        # One file after the other: the same record order on every worker.
        records = tf.data.Dataset.from_tensor_slices(order).flat_map(
            lambda path: tf.data.TFRecordDataset(path, compression)
        )
        if not shuffle:
            return records

        def shuffled(block, values):
            block_seed = tf.random.experimental.stateless_fold_in(epoch_seed, block)
            return tf.data.Dataset.from_tensor_slices(
                tf.random.experimental.stateless_shuffle(values, block_seed)
            )

        return records.batch(shuffle_buffer).enumerate().flat_map(shuffled)

    epochs = tf.data.Dataset.range(first_epoch, tf.int64.max)
    return epochs.flat_map(epoch_records).skip(offset)


def worker_records(
    manifest: Manifest,
    data_dir: str,
    split: str,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    repeat: bool,
    num_shards: int,
    shard_index: int,
    shuffle_buffer: int,
    deterministic: bool,
    equal_steps: Optional[bool],
    verify_checksums: bool,
    skip_corrupt: bool,
    cursor: Optional[int] = None,
) -> tf.data.Dataset:
    """Serialized records for one worker: sharded, shuffled, cut to equal epochs, repeated.

    The part of the pipeline every record format shares; see `make_dataset`
    for the arguments. Returns a dataset of scalar tf.string records.
    """
    if cursor is not None:
        return _worker_records_from_cursor(
            manifest, data_dir, split, shuffle=shuffle, seed=seed, repeat=repeat,
            num_shards=num_shards, shard_index=shard_index, shuffle_buffer=shuffle_buffer,
            verify_checksums=verify_checksums, skip_corrupt=skip_corrupt, cursor=cursor,
        )
    shards = _split_shards(manifest, split, data_dir)
    compression = manifest.get("compression")
    # Every listed file must be there (any worker finding a hole reports it);
    # checksums only for the files this worker will actually read.
    _check_shard_files(data_dir, shards, verify_checksums=False)
    files, by_record = worker_shards(shards, num_shards, shard_index)
    explicit = equal_steps is not None
    if equal_steps is None:
        equal_steps = repeat
    records_per_epoch = None
    if equal_steps:
        counts = records_per_worker(manifest, split, num_shards)
        steps = min(counts) // batch_size
        if steps < 1 and not explicit:
            # A repeated split smaller than one batch per worker: batches then
            # span epochs, and every worker runs forever anyway.
            equal_steps = False
        elif steps < 1:
            raise DataError(
                f"{data_dir}: split {split!r} gives some worker only {min(counts)} record(s) "
                f"with num_workers={num_shards}, fewer than batch_size={batch_size}"
            )
        else:
            records_per_epoch = steps * batch_size
    skipped = []
    if skip_corrupt:
        intact = []
        for shard in files:
            path = os.path.join(data_dir, shard["filename"])
            if _sha256(path) == shard["sha256"]:
                intact.append(shard)
            else:
                skipped.append(shard)
        if skipped:
            lost = sum(shard["sequences"] for shard in skipped)
            warnings.warn(
                f"skipping {len(skipped)} corrupted shard(s) of {len(files)} "
                f"({lost} record(s)) for worker {shard_index}: "
                + ", ".join(os.path.join(data_dir, shard["filename"]) for shard in skipped),
                CorruptShardWarning,
                stacklevel=3,
            )
        if not intact:
            raise DataError(
                f"{data_dir}: every shard worker {shard_index} would read is corrupted: "
                + ", ".join(shard["filename"] for shard in skipped)
            )
        files = intact
    elif verify_checksums:
        _check_shard_files(data_dir, files, verify_checksums=True, compression=compression)
    paths = [os.path.join(data_dir, shard["filename"]) for shard in files]

    dataset = tf.data.Dataset.from_tensor_slices(paths)
    if shuffle:
        # Same seed on every worker: with record-level sharding all workers must
        # walk the files in the same order for `shard` to give disjoint records.
        dataset = dataset.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.interleave(
        lambda path: tf.data.TFRecordDataset(path, compression_type=compression or ""),
        cycle_length=min(len(paths), 16),
        num_parallel_calls=tf.data.AUTOTUNE,
        # Record sharding needs the same record order on every worker.
        deterministic=deterministic or by_record,
    )
    if by_record:
        # Applied before any record shuffle: workers split one common order.
        dataset = dataset.shard(num_shards, shard_index)
    if shuffle:
        dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if records_per_epoch is not None:
        if skipped:
            # Fewer records than the other workers: top the epoch up from
            # this worker's intact shards so every worker runs as many steps.
            dataset = dataset.repeat()
        dataset = dataset.take(records_per_epoch)
    if repeat:
        dataset = dataset.repeat()
    return dataset


def _worker_records_from_cursor(manifest, data_dir, split, *, shuffle, seed, repeat, num_shards,
                                shard_index, shuffle_buffer, verify_checksums, skip_corrupt, cursor):
    """This worker's every `num_shards`-th record of `global_records` from `cursor`."""
    if not repeat:
        raise ValueError("`cursor` reads an endless stream of epochs. Received: repeat=False")
    if skip_corrupt:
        raise ValueError(
            "`cursor` needs every worker to read the same records: it cannot leave out "
            "corrupted shards. Received: skip_corrupt=True"
        )
    shards = _split_shards(manifest, split, data_dir)
    _check_shard_files(data_dir, shards, verify_checksums, manifest.get("compression"))
    records = global_records(manifest, data_dir, split, shuffle=shuffle, seed=seed,
                             shuffle_buffer=shuffle_buffer, cursor=cursor)
    return records.shard(num_shards, shard_index)


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
    equal_steps: Optional[bool] = None,
    skip_corrupt: bool = False,
    cursor: Optional[int] = None,
) -> tf.data.Dataset:
    """Build the `(inputs, targets)` pipeline for one worker.

    Args:
        data_dir: str. A directory written by `python -m pipelines.prepare`
            (packed format).
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
        deterministic: bool. Keep element order reproducible (and a restored
            iterator exact) at some cost in throughput. Forced on internally
            where record-level sharding needs it for disjointness.
        verify_checksums: bool. Also hash this worker's shards and compare with
            the manifest before reading (a full read of the files).
        equal_steps: bool or None. Cut every worker's epoch to the same
            number of full batches (`steps_per_epoch`); True raises
            `DataError` if some worker cannot make one batch. None: True when
            `repeat` and every worker can make a batch, else False.
        skip_corrupt: bool. Check this worker's shards' checksums and leave
            out corrupted ones with a `CorruptShardWarning` instead of failing.
        cursor: int or None. Read the global order (`global_records`) from
            this position, every `num_shards`-th record from `shard_index`
            on (elastic training); needs `repeat` and no `skip_corrupt`.
            `equal_steps` does not apply (the stream is endless) and the
            order is always deterministic. None: the per-worker sharding
            above.

    Returns:
        tf.data.Dataset of `(inputs, targets)`, int32, each of shape
        `(batch_size, seq_len)`.
    """
    manifest, num_shards, shard_index = open_data_dir(
        data_dir,
        PACKED_FORMAT,
        "make_dataset",
        batch_size=batch_size,
        num_shards=num_shards,
        shard_index=shard_index,
        input_context=input_context,
        shuffle_buffer=shuffle_buffer,
    )
    dataset = worker_records(
        manifest,
        data_dir,
        split,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        repeat=repeat,
        num_shards=num_shards,
        shard_index=shard_index,
        shuffle_buffer=shuffle_buffer,
        deterministic=deterministic,
        equal_steps=equal_steps,
        verify_checksums=verify_checksums,
        skip_corrupt=skip_corrupt,
        cursor=cursor,
    )
    record_length = manifest["record_length"]
    feature_name = manifest["feature"]
    dataset = dataset.batch(batch_size, drop_remainder=True)

    features = {feature_name: tf.io.FixedLenFeature([record_length], tf.int64)}

    def split_inputs_and_targets(serialized):
        token_ids = tf.io.parse_example(serialized, features)[feature_name]
        token_ids = tf.cast(token_ids, tf.int32)  # (B, T + 1)
        return token_ids[:, :-1], token_ids[:, 1:]  # (B, T), (B, T)

    dataset = dataset.map(
        split_inputs_and_targets,
        num_parallel_calls=tf.data.AUTOTUNE,
        # The global order's batches are its positions: never reordered.
        deterministic=deterministic or cursor is not None,
    )
    return dataset.prefetch(tf.data.AUTOTUNE)
