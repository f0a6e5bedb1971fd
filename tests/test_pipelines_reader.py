"""The tf.data reader at scale: worker sharding, equal steps, exact resume, corrupted shards.

Oracles: the split's records read by one plain pipeline (workers must
partition them), `steps_per_epoch` (every worker must make exactly that many
batches), an uninterrupted iterator (a restored one must continue with the
same batches), and the byte offsets of the records in a shard (the error
must name the record that was damaged).
"""

import os
import shutil
import struct
import warnings
from collections import Counter

import numpy as np
import pytest
import tensorflow as tf

from pipelines import prepare, reader
from pipelines.errors import DataError
from pipelines.tokenizer import train_tokenizer
from tests.test_pipelines import (
    SEQ_LEN,
    VOCABULARY_SIZE,
    make_documents,
    write_json_lines_file,
)

BATCH_SIZE = 3


@pytest.fixture(scope="module")
def dataset_directory(tmp_path_factory):
    """Seven train shards (not a multiple of 2 or 3 workers), plain and GZIP."""
    directory = tmp_path_factory.mktemp("reader")
    documents = make_documents(260, seed=31)
    write_json_lines_file(directory / "corpus.jsonl", documents)
    tokenizer = directory / "tokenizer.model"
    train_tokenizer(documents, VOCABULARY_SIZE, str(tokenizer), num_threads=1)
    manifests = {}
    for name, compression in (("plain", None), ("gzip", "GZIP")):
        manifests[name] = prepare.prepare(
            str(directory / name),
            [str(directory / "corpus.jsonl")],
            seq_len=SEQ_LEN,
            tokenizer_path=str(tokenizer),
            shard_size=9000,
            val_fraction=0.1,
            workers=1,
            compression=compression,
            log=lambda message: None,
        )
    assert len(manifests["plain"]["splits"]["train"]["shards"]) == 7
    return {name: (str(directory / name), manifest) for name, manifest in manifests.items()}


def rows(batches):
    """Each record of some (inputs, targets) batches as a tuple."""
    records = []
    for inputs, targets in batches:
        full = np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1)
        records.extend(tuple(row) for row in full.tolist())
    return records


def all_records(data_dir):
    dataset = reader.make_dataset(
        data_dir, "train", 1, shuffle=False, repeat=False, deterministic=True
    )
    return rows(dataset)


@pytest.mark.parametrize("number_of_workers", [2, 3, 9])
def test_workers_together_see_every_sequence_exactly_once_per_epoch(
    dataset_directory, number_of_workers
):
    data_dir, manifest = dataset_directory["plain"]
    everything = all_records(data_dir)
    seen = []
    for index in range(number_of_workers):
        dataset = reader.make_dataset(
            data_dir,
            "train",
            1,
            shuffle=True,
            seed=7,
            repeat=False,
            num_shards=number_of_workers,
            shard_index=index,
            deterministic=False,
        )
        seen.extend(rows(dataset))
    # Every record once: none missing, none seen by two workers (or twice by
    # one). Compared as multisets: two records may hold the same tokens.
    assert sorted(seen) == sorted(everything)


@pytest.mark.parametrize("number_of_workers", [3, 9])  # By file (7 files) and by record.
def test_every_worker_runs_the_same_number_of_steps(dataset_directory, number_of_workers):
    data_dir, manifest = dataset_directory["plain"]
    counts = reader.records_per_worker(manifest, "train", number_of_workers)
    assert len(set(counts)) > 1  # Uneven: without equal steps the workers would differ.
    steps = reader.steps_per_epoch(data_dir, "train", BATCH_SIZE, number_of_workers)
    assert steps == min(counts) // BATCH_SIZE
    size = steps * BATCH_SIZE
    everything = Counter(all_records(data_dir))
    epochs = [Counter() for _ in range(3)]  # All workers' records, per epoch.
    for index in range(number_of_workers):
        one_epoch = reader.make_dataset(
            data_dir,
            "train",
            BATCH_SIZE,
            seed=2,
            repeat=False,
            equal_steps=True,
            num_shards=number_of_workers,
            shard_index=index,
        )
        assert sum(1 for _ in one_epoch) == steps
        # Repeating: epochs of exactly `steps` batches, aligned across workers.
        repeated = reader.make_dataset(
            data_dir, "train", BATCH_SIZE, seed=2, num_shards=number_of_workers, shard_index=index
        )
        records = rows(repeated.take(3 * steps))
        for epoch in range(3):
            epochs[epoch].update(records[epoch * size : (epoch + 1) * size])
    for epoch in epochs:
        assert sum(epoch.values()) == number_of_workers * size
        # Within an epoch no record is read twice, by one worker or by two.
        assert not epoch - everything
    # Each epoch leaves out a different surplus (the record shuffle differs).
    assert len({frozenset(epoch.items()) for epoch in epochs}) > 1


def read_in_lockstep(data_dir, phases, seed, shuffle_buffer=64):
    """The records that workers reading from a global cursor consume, by stream position.

    `phases` is a list of `(workers, steps)`: each phase starts every
    worker's pipeline at the cursor the previous phases reached, as an
    elastic run does after each change of world size, and its workers take
    `BATCH_SIZE` records each per step. Worker r's j-th record of a step
    that starts at position p is position p + j * W + r.
    """
    consumed, cursor = [], 0
    for workers, steps in phases:
        batches = [
            rows(reader.make_dataset(data_dir, "train", BATCH_SIZE, seed=seed,
                                     shuffle_buffer=shuffle_buffer, cursor=cursor,
                                     num_shards=workers, shard_index=rank).take(steps))
            for rank in range(workers)
        ]
        for step in range(steps):
            for position in range(BATCH_SIZE * workers):
                index, rank = divmod(position, workers)
                consumed.append(batches[rank][step * BATCH_SIZE + index])
        cursor += steps * BATCH_SIZE * workers
    return consumed


def test_a_world_size_going_2_1_2_reads_each_sequence_once_per_epoch(dataset_directory):
    data_dir, manifest = dataset_directory["plain"]
    everything = all_records(data_dir)
    epoch = len(everything)
    # 2 workers, then 1, then 2 again, past the end of the first epoch.
    first, second = 11, 17
    third = (epoch - BATCH_SIZE * (2 * first + second)) // (2 * BATCH_SIZE) + 4
    consumed = read_in_lockstep(data_dir, [(2, first), (1, second), (2, third)], seed=4)
    assert len(consumed) > epoch
    # Oracle: one pipeline reading the whole global order from position 0.
    stream = reader.global_records(manifest, data_dir, "train", shuffle=True, seed=4,
                                   shuffle_buffer=64, cursor=0)
    expected = [
        tuple(tf.io.parse_single_example(
            record, {"input_ids": tf.io.FixedLenFeature([SEQ_LEN + 1], tf.int64)}
        )["input_ids"].numpy().tolist())
        for record in stream.take(len(consumed))
    ]
    assert consumed == expected
    # The first epoch is the split, each sequence once (a multiset: two
    # records may hold the same tokens); the second is in another order.
    assert sorted(consumed[:epoch]) == sorted(everything)
    assert consumed[epoch:] != expected[: len(consumed) - epoch]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(repeat=False), "endless stream of epochs. Received: repeat=False"),
        (dict(skip_corrupt=True), "cannot leave out corrupted shards. Received: skip_corrupt=True"),
        (dict(cursor=-1), "must be a non-negative int. Received: cursor=-1"),
    ],
)
def test_cursor_refuses_what_would_break_the_global_order(dataset_directory, options, message):
    data_dir, _ = dataset_directory["plain"]
    options = dict(dict(cursor=0), **options)
    with pytest.raises(ValueError, match=message):
        reader.make_dataset(data_dir, "train", BATCH_SIZE, **options)


CHECKPOINT_CASES = {
    "one_worker_shuffled": dict(num_shards=1, shard_index=0),
    "by_file": dict(num_shards=2, shard_index=1),
    "by_record": dict(num_shards=9, shard_index=4),
    "unshuffled_one_epoch": dict(shuffle=False, repeat=False),
    "gzip": dict(num_shards=2, shard_index=0, data="gzip"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_restored_iterator_continues_with_the_next_batches(dataset_directory, tmp_path, case):
    options = dict(CHECKPOINT_CASES[case])
    data_dir, _ = dataset_directory[options.pop("data", "plain")]
    options = dict(dict(seed=5, shuffle_buffer=64, deterministic=True), **options)

    def build():
        return reader.make_dataset(data_dir, "train", BATCH_SIZE, **options)

    iterator = iter(build())
    for _ in range(4):
        next(iterator)
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "ckpt"))
    # Far enough to cross an epoch boundary (a worker's epoch is a few batches).
    expected = rows(batch for _, batch in zip(range(40), iterator))

    restored = iter(build())
    tf.train.Checkpoint(iterator=restored).restore(path).assert_consumed()
    actual = rows(batch for _, batch in zip(range(40), restored))
    assert actual == expected
    assert len(actual) > 0


def test_nondeterministic_resume_neither_repeats_nor_loses_a_record(dataset_directory, tmp_path):
    data_dir, _ = dataset_directory["plain"]

    def build():
        return reader.make_dataset(
            data_dir, "train", 1, seed=9, repeat=False, deterministic=False, shuffle_buffer=50
        )

    iterator = iter(build())
    before = rows(batch for _, batch in zip(range(30), iterator))
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "ckpt"))
    restored = iter(build())
    tf.train.Checkpoint(iterator=restored).restore(path)
    after = rows(restored)
    assert sorted(before + after) == sorted(all_records(data_dir))


# ----------------------------------------------------------------------------
# Corrupted shards.


def record_offsets(path):
    """(start, end) byte offsets of each record's data in an uncompressed TFRecord file."""
    offsets = []
    with open(path, "rb") as shard_file:
        data = shard_file.read()
    position = 0
    while position < len(data):
        (length,) = struct.unpack("<Q", data[position : position + 8])
        start = position + 12
        offsets.append((start, start + length))
        position = start + length + 4
    return offsets


def damaged_copy(dataset_directory, tmp_path, shard_number, record_number):
    data_dir, manifest = dataset_directory["plain"]
    copy = str(tmp_path / "copy")
    shutil.copytree(data_dir, copy)
    name = manifest["splits"]["train"]["shards"][shard_number]["filename"]
    path = os.path.join(copy, name)
    start, end = record_offsets(path)[record_number]
    with open(path, "r+b") as shard_file:
        shard_file.seek((start + end) // 2)
        byte = shard_file.read(1)
        shard_file.seek((start + end) // 2)
        shard_file.write(bytes([byte[0] ^ 0x5A]))
    return copy, name


def test_a_damaged_record_is_named_by_file_and_record(dataset_directory, tmp_path):
    copy, name = damaged_copy(dataset_directory, tmp_path, shard_number=2, record_number=6)
    dataset = reader.make_dataset(copy, "train", BATCH_SIZE, seed=1)
    # tf.data fails fast (no hang) but cannot say where.
    with pytest.raises(tf.errors.DataLossError):
        for _ in dataset.take(200):
            pass
    with pytest.raises(
        DataError, match=rf"{name}: shard is corrupted: sha256 .* reading fails at record 6 "
    ):
        reader.verify_shards(copy)


def test_a_shard_truncated_while_training_is_named(dataset_directory, tmp_path):
    data_dir, manifest = dataset_directory["plain"]
    copy = str(tmp_path / "copy")
    shutil.copytree(data_dir, copy)
    dataset = reader.make_dataset(copy, "train", BATCH_SIZE, seed=1)  # Sizes checked here.
    name = manifest["splits"]["train"]["shards"][4]["filename"]
    path = os.path.join(copy, name)
    start, end = record_offsets(path)[10]
    with open(path, "r+b") as shard_file:
        shard_file.truncate(start + 3)
    with pytest.raises(tf.errors.DataLossError):
        for _ in dataset.take(200):
            pass
    with pytest.raises(DataError, match=rf"{name}: shard is corrupted or truncated: .*record 10 "):
        reader.verify_shards(copy)


def test_skip_corrupt_leaves_out_the_shard_with_a_counted_warning(dataset_directory, tmp_path):
    copy, name = damaged_copy(dataset_directory, tmp_path, shard_number=2, record_number=0)
    _, manifest = dataset_directory["plain"]
    lost = manifest["splits"]["train"]["shards"][2]["sequences"]
    # Two workers by file: worker 0 reads shards 0, 2, 4, 6.
    with pytest.warns(
        reader.CorruptShardWarning,
        match=rf"skipping 1 corrupted shard\(s\) of 4 \({lost} record\(s\)\) "
        rf"for worker 0: .*{name}",
    ):
        dataset = reader.make_dataset(
            copy,
            "train",
            BATCH_SIZE,
            repeat=False,
            equal_steps=True,
            num_shards=2,
            shard_index=0,
            skip_corrupt=True,
        )
    batches = list(dataset)  # No DataLossError.
    # Topped up from the intact shards: still as many steps as the other worker.
    assert len(batches) == reader.steps_per_epoch(copy, "train", BATCH_SIZE, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader.make_dataset(
            copy, "train", BATCH_SIZE, num_shards=2, shard_index=1, skip_corrupt=True
        )


def test_reader_rejects_the_other_record_format(dataset_directory, tmp_path):
    data_dir, _ = dataset_directory["plain"]
    with pytest.raises(
        DataError, match=r"holds 'tfgpt-packed-tokens' records, make_encoder_dataset reads"
    ):
        from pipelines.encoder_data import make_encoder_dataset

        make_encoder_dataset(data_dir, "train", BATCH_SIZE)
