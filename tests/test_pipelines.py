"""Data path: tokenizer, prepare CLI, TFRecord reader — round trips against the inputs.

The oracle for every prepare/reader test is the list of documents the test
wrote itself: records read back through the real reader must decode to those
documents joined by EOS. The tokenizer uses the `identity` normalization rule
and no dummy prefix, so decoding is exact (not "modulo normalization").
"""

import argparse
import glob
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from pipelines import default_corpus, prepare, reader
from pipelines import manifest as data_format
from pipelines.errors import DataError
from pipelines.prepare import cli, resume, shard_writer
from pipelines.tfrecord import serialize_records
from pipelines.tokenizer import Tokenizer, train_tokenizer

# A vocabulary must hold 3 special + 256 byte pieces + the corpus's characters;
# 384 leaves room for ~60 characters and ~60 merges. Distinct from seq_len etc.
VOCABULARY_SIZE = 384
SEQ_LEN = 11  # Records hold 12 tokens.
TINY_SHARD_SIZE = "3K"  # About 50 records per shard: over ten shards.
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = (
    "tensor shard record token vocabulary gradient layer model batch worker "
    "epoch corpus merge piece byte stream manifest reader writer seed split "
    "train valid document sample encode decode python rank allreduce horovod"
).split()


def make_documents(count, seed, words_per_document=(4, 30)):
    """Distinct multi-sentence documents from a fixed word list."""
    generator = random.Random(seed)
    documents = []
    for index in range(count):
        number_of_words = generator.randint(*words_per_document)
        words = [generator.choice(WORDS) for _ in range(number_of_words)]
        documents.append(f"Doc {seed}-{index}: " + " ".join(words) + ".")
    return documents


# Edge cases every document reader and the tokenizer must keep verbatim:
# runs of spaces, tabs, leading indentation, non-ASCII, and inner newlines.
SPECIAL_TEXT_DOCUMENTS = [
    "  indented first line\n\tand a tabbed line   with  runs of spaces",
    "naïve café — 日本語 ✓ 🎉",
]
SPECIAL_JSON_DOCUMENTS = [
    "multi\nline\n\n\nwith blank lines inside a JSON document\n",
    "Windows line end\r\nkept in JSON",
    "a literal <|endoftext|> in text is not the EOS token",
]


def write_text_file(path, documents, crlf=False):
    """Blank-line separated blocks, with extra whitespace-only separators."""
    separator_choices = ["\n\n", "\n\n\n", "\n   \n", "\n\t\n\n"]
    text = ""
    for index, document in enumerate(documents):
        text += document + separator_choices[index % len(separator_choices)]
    if crlf:
        text = text.replace("\n", "\r\n")
    with open(path, "w", encoding="utf-8", newline="") as output_file:
        output_file.write(text)


def write_json_lines_file(path, documents, extra_lines=()):
    with open(path, "w", encoding="utf-8") as output_file:
        for document in documents:
            output_file.write(json.dumps({"text": document, "meta": {"source": "test"}}) + "\n")
        for line in extra_lines:
            output_file.write(line + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three input files (text with LF, text with CRLF in a directory, JSON Lines).

    Returns the input arguments and the documents in the order prepare reads them.
    """
    directory = tmp_path_factory.mktemp("inputs")
    text_documents = SPECIAL_TEXT_DOCUMENTS + make_documents(60, seed=1)
    crlf_documents = make_documents(40, seed=2)
    json_documents = SPECIAL_JSON_DOCUMENTS + make_documents(50, seed=3)
    write_text_file(directory / "a.txt", text_documents)
    (directory / "nested").mkdir()
    write_text_file(directory / "nested" / "b.txt", crlf_documents, crlf=True)
    # Blank lines and a whitespace-only text are skipped, not documents.
    write_json_lines_file(
        directory / "c.jsonl", json_documents, extra_lines=["", json.dumps({"text": "  \n "})]
    )
    inputs = [str(directory / "a.txt"), str(directory / "nested"), str(directory / "*.jsonl")]
    expected = text_documents + crlf_documents + json_documents
    return {"directory": directory, "inputs": inputs, "documents": expected}


def run_prepare(output_directory, inputs, *extra):
    argv = ["--output", str(output_directory), "--seq-len", str(SEQ_LEN)]
    argv += ["--vocab-size", str(VOCABULARY_SIZE), "--shard-size", TINY_SHARD_SIZE]
    for path in inputs:
        argv += ["--input", path]
    status = prepare.main(argv + list(extra))
    assert status == 0
    with open(os.path.join(output_directory, "manifest.json")) as manifest_file:
        return json.load(manifest_file)


@pytest.fixture(scope="module")
def all_train_dataset(corpus, tmp_path_factory):
    """Everything in train (`--val-fraction 0`), so the stream is the corpus in order."""
    output_directory = tmp_path_factory.mktemp("all_train")
    manifest = run_prepare(output_directory, corpus["inputs"], "--val-fraction", "0")
    return str(output_directory), manifest


@pytest.fixture(scope="module")
def split_dataset(corpus, tmp_path_factory):
    output_directory = tmp_path_factory.mktemp("split")
    manifest = run_prepare(
        output_directory, corpus["inputs"], "--val-fraction", "0.25", "--seed", "7"
    )
    return str(output_directory), manifest


def read_records(data_dir, split, **options):
    """All records of one reader pipeline, as a list of 1-D int arrays (seq_len + 1)."""
    options = dict(dict(shuffle=False, repeat=False, deterministic=True), **options)
    records = []
    for inputs, targets in reader.make_dataset(data_dir, split, batch_size=1, **options):
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        records.append(np.concatenate([inputs[0].numpy(), targets[0, -1:].numpy()]))
    return records


def read_stream(data_dir, split, manifest):
    """The split's token stream in write order, through the real reader.

    Reading with one worker per shard file makes each pipeline read exactly
    one file, in order (a single pipeline interleaves files).
    """
    number_of_files = len(manifest["splits"][split]["shards"])
    stream = []
    for index in range(number_of_files):
        records = read_records(data_dir, split, num_shards=number_of_files, shard_index=index)
        stream.extend(np.concatenate(records).tolist())
    return stream


def decode_documents(tokenizer, stream):
    """Split a stream at EOS: (complete documents, decoded unterminated tail)."""
    segments = []
    current = []
    for token_id in stream:
        if token_id == tokenizer.eos_id:
            segments.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token_id)
    # A record boundary may cut a multi-byte character; its decoded bytes are U+FFFD.
    return segments, tokenizer.decode(current).rstrip("\ufffd")


# ----------------------------------------------------------------------------
# Tokenizer.


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"
    documents = make_documents(200, seed=11) + SPECIAL_TEXT_DOCUMENTS
    trained = train_tokenizer(documents, VOCABULARY_SIZE, str(path), num_threads=1)
    assert path.exists()
    return trained


TRICKY_STRINGS = [
    "tensor shard record",
    "  two leading spaces, trailing tab\t",
    "line one\nline two\n\n\nafter blank lines",
    "naïve café — 日本語 ✓ 🎉 (outside the vocabulary: byte fallback)",
    "digits 1234567890 and a literal <|endoftext|>",
]


def test_tokenizer_decode_inverts_encode_exactly(tokenizer):
    for text in TRICKY_STRINGS:
        token_ids = tokenizer.encode(text)
        assert tokenizer.eos_id not in token_ids  # Literal EOS text is not EOS.
        assert tokenizer.decode(token_ids) == text


def test_tokenizer_special_ids_and_size(tokenizer, tmp_path):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.eos_id, tokenizer.bos_id) == (0, 1, 2, -1)
    assert tokenizer.id_to_piece(tokenizer.eos_id) == "<|endoftext|>"
    assert tokenizer.vocabulary_size == VOCABULARY_SIZE
    assert tokenizer.decode([tokenizer.pad_id, tokenizer.eos_id]) == ""
    assert tokenizer.settings() == {
        "model_type": "bpe",
        "byte_fallback": True,
        "normalization": "identity",
        "add_dummy_prefix": False,
    }
    path = tmp_path / "copy.model"
    path.write_bytes(tokenizer.model_proto)
    loaded = Tokenizer.load(str(path))
    assert loaded.encode(TRICKY_STRINGS[3]) == tokenizer.encode(TRICKY_STRINGS[3])


def test_tokenizer_encode_batch_equals_encode(tokenizer):
    expected = [tokenizer.encode(text) for text in TRICKY_STRINGS]
    assert tokenizer.encode_batch(TRICKY_STRINGS, num_threads=2) == expected


def test_tf_tokenizer_ids_equal_python_ids(tokenizer):
    tf_tokenizer = tokenizer.tf_tokenizer()
    ragged = tf_tokenizer.tokenize(tf.constant(TRICKY_STRINGS))
    assert ragged.dtype == tf.int32
    assert ragged.to_list() == [tokenizer.encode(text) for text in TRICKY_STRINGS]
    detokenized = tf_tokenizer.detokenize(ragged).numpy()
    assert [text.decode("utf-8") for text in detokenized] == TRICKY_STRINGS


def test_tokenizer_errors(tmp_path):
    with pytest.raises(
        ValueError, match=r"`vocabulary_size` must be at least 260.*Received: vocabulary_size=100"
    ):
        train_tokenizer(["text"], 100, None)
    with pytest.raises(ValueError, match="Use a smaller --vocab-size"):
        train_tokenizer(["tiny corpus"] * 3, 5000, None)
    with pytest.raises(ValueError, match="no non-whitespace text"):
        train_tokenizer(["  ", "\n"], 300, None)
    with pytest.raises(ValueError, match="Cannot read tokenizer model"):
        Tokenizer.load(str(tmp_path / "missing.model"))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model: .*not a valid SentencePiece model"):
        Tokenizer.load(str(tmp_path / "bad.model"))


# ----------------------------------------------------------------------------
# prepare -> reader round trip.


def test_round_trip_stream_decodes_to_the_documents(corpus, all_train_dataset):
    data_dir, manifest = all_train_dataset
    tokenizer = Tokenizer.load(os.path.join(data_dir, "tokenizer.model"))
    documents = corpus["documents"]
    stream = read_stream(data_dir, "train", manifest)

    complete, tail = decode_documents(tokenizer, stream)
    assert complete == documents[: len(complete)]
    # The dropped tail is shorter than one record, so at most the last few
    # (short) documents are lost, and the kept part of the next one is a prefix.
    assert len(complete) >= len(documents) - 3
    assert documents[len(complete)].startswith(tail)

    # Counts: every document's tokens plus its EOS; records are whole chunks.
    expected_tokens = sum(len(tokenizer.encode(document)) + 1 for document in documents)
    train = manifest["splits"]["train"]
    record_length = SEQ_LEN + 1
    assert manifest["record_length"] == record_length
    assert len(stream) == train["sequences"] * record_length
    assert train["tokens"] == manifest["totals"]["tokens"] == expected_tokens
    assert train["dropped_tail_tokens"] == expected_tokens - len(stream)
    assert 0 <= train["dropped_tail_tokens"] < record_length
    assert train["documents"] == manifest["totals"]["documents"] == len(documents)
    assert manifest["totals"]["skipped_empty_documents"] == 1
    assert manifest["splits"]["val"] == {
        "documents": 0,
        "tokens": 0,
        "sequences": 0,
        "dropped_tail_tokens": 0,
        "shards": [],
    }


def test_round_trip_shards_match_manifest(all_train_dataset):
    data_dir, manifest = all_train_dataset
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) >= 3  # The tiny shard size forced several shards.
    expected_names = [
        f"train-{index:05d}-of-{len(shards):05d}.tfrecord" for index in range(len(shards))
    ]
    assert [shard["filename"] for shard in shards] == expected_names
    on_disk = sorted(os.path.basename(path) for path in glob.glob(os.path.join(data_dir, "*")))
    assert on_disk == sorted(expected_names + ["manifest.json", "tokenizer.model"])
    for index, shard in enumerate(shards):
        path = os.path.join(data_dir, shard["filename"])
        with open(path, "rb") as shard_file:
            assert hashlib.sha256(shard_file.read()).hexdigest() == shard["sha256"]
        assert os.path.getsize(path) == shard["bytes"] <= prepare.parse_size(TINY_SHARD_SIZE)
        records = read_records(data_dir, "train", num_shards=len(shards), shard_index=index)
        assert len(records) == shard["sequences"]
        assert shard["tokens"] == shard["sequences"] * manifest["record_length"]
    with open(os.path.join(data_dir, "tokenizer.model"), "rb") as model_file:
        assert hashlib.sha256(model_file.read()).hexdigest() == manifest["tokenizer"]["sha256"]
    assert manifest["tokenizer"]["vocabulary_size"] == VOCABULARY_SIZE
    assert manifest["format_version"] == 1 and manifest["feature"] == "input_ids"


def assert_follows_schema(manifest):
    """Every key the writer wrote is declared in `pipelines.manifest`, in the declared order."""

    def check(schema, entry):
        declared = [
            key
            for key in schema.__annotations__
            if key in schema.__required_keys__ or key in entry
        ]
        assert list(entry) == declared, schema.__name__

    check(data_format.Manifest, manifest)
    check(data_format.TokenizerDescription, manifest["tokenizer"])
    check(data_format.Totals, manifest["totals"])
    assert list(manifest["splits"]) == list(data_format.SPLITS)
    encoder = manifest["format"] == data_format.ENCODER_FORMAT
    for split in manifest["splits"].values():
        check(data_format.Split, split)
        assert ("segments" in split) == encoder  # The one optional key.
        for shard in split["shards"]:
            check(data_format.Shard, shard)


def test_manifest_follows_the_schema_the_readers_use(all_train_dataset):
    _, manifest = all_train_dataset
    assert_follows_schema(manifest)
    assert manifest["format"] == "tfgpt-packed-tokens" == reader.PACKED_FORMAT
    # A key the writer adds, drops or reorders is a schema change: it must fail.
    for changed in (
        dict(manifest, extra=1),
        {key: value for key, value in manifest.items() if key != "seed"},
        dict(reversed(list(manifest.items()))),
    ):
        with pytest.raises(AssertionError):
            assert_follows_schema(changed)


def test_records_are_tf_train_examples_with_one_int64_feature(all_train_dataset):
    data_dir, manifest = all_train_dataset
    path = os.path.join(data_dir, manifest["splits"]["train"]["shards"][0]["filename"])
    serialized = next(iter(tf.data.TFRecordDataset(path))).numpy()
    example = tf.train.Example.FromString(serialized)
    assert list(example.features.feature) == ["input_ids"]
    assert len(example.features.feature["input_ids"].int64_list.value) == SEQ_LEN + 1


def test_serialize_records_matches_protobuf():
    generator = np.random.default_rng(0)
    # Every varint length from 1 to 9 bytes, and ids near each boundary.
    boundaries = [0, 1, 127, 128, 16383, 16384, 2**21, 2**28 + 5, 2**35, 2**56, 2**63 - 1]
    records = generator.integers(0, 2**31, size=(5, 13))
    records[0, : len(boundaries)] = boundaries
    records[1] = generator.integers(0, 300, size=13)
    for row, serialized in zip(records, serialize_records(records)):
        expected = tf.train.Example(
            features=tf.train.Features(
                feature={
                    "input_ids": tf.train.Feature(int64_list=tf.train.Int64List(value=row.tolist()))
                }
            )
        ).SerializeToString()
        assert serialized == expected
    long_records = generator.integers(0, 50_000, size=(2, 1025))  # Multi-byte lengths.
    for row, serialized in zip(long_records, serialize_records(long_records)):
        assert (
            tf.train.Example.FromString(serialized).features.feature["input_ids"].int64_list.value
            == row.tolist()
        )
    with pytest.raises(ValueError, match="`records` must be non-negative. Received: minimum -1"):
        serialize_records(np.array([[3, -1]]))


def test_make_dataset_batches_have_static_int32_shapes(all_train_dataset):
    data_dir, _ = all_train_dataset
    dataset = reader.make_dataset(data_dir, "train", batch_size=3, seed=5)
    assert dataset.element_spec == (
        tf.TensorSpec((3, SEQ_LEN), tf.int32),
        tf.TensorSpec((3, SEQ_LEN), tf.int32),
    )
    for inputs, targets in dataset.take(4):  # repeat=True: more batches than one epoch holds.
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


# ----------------------------------------------------------------------------
# Train/validation split.


def test_split_is_by_whole_document(corpus, split_dataset):
    data_dir, manifest = split_dataset
    tokenizer = Tokenizer.load(os.path.join(data_dir, "tokenizer.model"))
    documents = corpus["documents"]
    decoded = {}
    for split in ("train", "val"):
        complete, tail = decode_documents(tokenizer, read_stream(data_dir, split, manifest))
        decoded[split] = complete
        # Each split keeps the corpus's relative order.
        positions = [documents.index(document) for document in complete]
        assert positions == sorted(positions)
        if tail:
            following = documents[positions[-1] + 1 :]
            assert any(document.startswith(tail) for document in following)
    train, val = set(decoded["train"]), set(decoded["val"])
    assert train and val
    assert not train & val
    # Only the documents cut off by the two dropped tails are missing.
    assert len(train) + len(val) >= len(documents) - 6
    assert manifest["splits"]["val"]["sequences"] >= 1
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == len(
        documents
    )
    val_share = manifest["splits"]["val"]["tokens"] / manifest["totals"]["tokens"]
    assert 0.15 < val_share < 0.4  # Asked for 25% of the bytes.


def test_same_seed_gives_identical_shards_and_other_seed_another_split(
    corpus, split_dataset, tmp_path
):
    _, manifest = split_dataset
    again = run_prepare(
        tmp_path / "again", corpus["inputs"], "--val-fraction", "0.25", "--seed", "7"
    )
    assert again["splits"] == manifest["splits"]
    assert again["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]
    other = run_prepare(
        tmp_path / "other", corpus["inputs"], "--val-fraction", "0.25", "--seed", "8"
    )
    assert other["splits"]["val"]["shards"] != manifest["splits"]["val"]["shards"]


# ----------------------------------------------------------------------------
# Workers.


def as_set(records):
    return {tuple(record.tolist()) for record in records}


def test_two_workers_by_file_see_disjoint_records_covering_the_split(all_train_dataset):
    data_dir, manifest = all_train_dataset
    everything = read_records(data_dir, "train")
    worker_records = [
        read_records(data_dir, "train", num_shards=2, shard_index=index, shuffle=True, seed=3)
        for index in range(2)
    ]
    first, second = (as_set(records) for records in worker_records)
    assert len(as_set(everything)) == len(everything)  # Records are distinct.
    assert not first & second
    assert first | second == as_set(everything)
    # File-level: each worker holds whole files, every other one.
    shards = manifest["splits"]["train"]["shards"]
    assert len(worker_records[1]) == sum(shard["sequences"] for shard in shards[1::2])
    assert reader.records_per_worker(manifest, "train", 2) == [
        len(records) for records in worker_records
    ]


def test_more_workers_than_files_shard_by_record(all_train_dataset):
    data_dir, manifest = all_train_dataset
    number_of_workers = len(manifest["splits"]["train"]["shards"]) + 1
    everything = as_set(read_records(data_dir, "train"))
    seen = set()
    counts = []
    for index in range(number_of_workers):
        # Shuffled with interleaving: workers must still agree on the record order.
        records = as_set(
            read_records(
                data_dir,
                "train",
                num_shards=number_of_workers,
                shard_index=index,
                shuffle=True,
                seed=4,
                deterministic=False,
            )
        )
        assert not seen & records
        seen |= records
        counts.append(len(records))
    assert seen == everything
    assert reader.records_per_worker(manifest, "train", number_of_workers) == counts


def test_input_context_overrides_num_shards(all_train_dataset):
    data_dir, _ = all_train_dataset
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1)
    from_context = read_records(
        data_dir, "train", input_context=context, num_shards=5, shard_index=0
    )
    from_arguments = read_records(data_dir, "train", num_shards=2, shard_index=1)
    assert as_set(from_context) == as_set(from_arguments)


@pytest.mark.parametrize("sharding", ["by_file", "by_record"])
def test_steps_per_epoch_is_the_minimum_over_workers(all_train_dataset, sharding):
    data_dir, manifest = all_train_dataset
    number_of_files = len(manifest["splits"]["train"]["shards"])
    number_of_workers = 2 if sharding == "by_file" else number_of_files + 1
    batch_size = 4
    batches = []
    for index in range(number_of_workers):
        dataset = reader.make_dataset(
            data_dir,
            "train",
            batch_size,
            shuffle=False,
            repeat=False,
            num_shards=number_of_workers,
            shard_index=index,
        )
        batches.append(sum(1 for _ in dataset))
    assert reader.steps_per_epoch(data_dir, "train", batch_size, number_of_workers) == min(batches)
    with pytest.raises(DataError, match="fewer than batch_size=100000"):
        reader.steps_per_epoch(data_dir, "train", 100000, number_of_workers)


# ----------------------------------------------------------------------------
# Reader errors.


def copy_dataset(source, destination):
    destination.mkdir()
    for path in glob.glob(os.path.join(source, "*")):
        with open(path, "rb") as source_file:
            (destination / os.path.basename(path)).write_bytes(source_file.read())
    return str(destination)


def test_truncated_shard_error_names_the_file(all_train_dataset, tmp_path):
    data_dir = copy_dataset(all_train_dataset[0], tmp_path / "copy")
    name = all_train_dataset[1]["splits"]["train"]["shards"][1]["filename"]
    path = os.path.join(data_dir, name)
    with open(path, "r+b") as shard_file:
        shard_file.truncate(os.path.getsize(path) - 7)
    with pytest.raises(DataError, match=f"{name}: shard is corrupted or truncated"):
        reader.make_dataset(data_dir, "train", batch_size=2)


def test_flipped_byte_is_found_by_checksum_verification(all_train_dataset, tmp_path):
    data_dir = copy_dataset(all_train_dataset[0], tmp_path / "copy")
    name = all_train_dataset[1]["splits"]["train"]["shards"][0]["filename"]
    path = os.path.join(data_dir, name)
    with open(path, "r+b") as shard_file:
        shard_file.seek(40)
        byte = shard_file.read(1)
        shard_file.seek(40)
        shard_file.write(bytes([byte[0] ^ 0xFF]))
    # Same size, so only the checksum can tell; tf.data alone would raise a
    # DataLossError that does not name the file.
    reader.make_dataset(data_dir, "train", batch_size=2)
    with pytest.raises(DataError, match=f"{name}: shard is corrupted: sha256"):
        reader.make_dataset(data_dir, "train", batch_size=2, verify_checksums=True)
    with pytest.raises(DataError, match=f"{name}: shard is corrupted: sha256"):
        reader.verify_shards(data_dir)


def test_reader_errors(all_train_dataset, tmp_path):
    with pytest.raises(
        DataError, match=r"no manifest.json in .*empty — run python -m pipelines.prepare first"
    ):
        reader.load_manifest(str(tmp_path / "empty"))
    data_dir, manifest = all_train_dataset
    with pytest.raises(DataError, match="split 'val' has no shards"):
        reader.make_dataset(data_dir, "val", batch_size=2)
    with pytest.raises(
        ValueError, match=r"`split` must be one of \['train', 'val'\]. Received: split='test'"
    ):
        reader.make_dataset(data_dir, "test", batch_size=2)
    with pytest.raises(
        ValueError, match="`batch_size` must be a positive int. Received: batch_size=0"
    ):
        reader.make_dataset(data_dir, "train", batch_size=0)
    with pytest.raises(
        ValueError,
        match=r"`shard_index` must be an int in \[0, num_shards\). Received: shard_index=2",
    ):
        reader.make_dataset(data_dir, "train", batch_size=2, num_shards=2, shard_index=2)
    copy = copy_dataset(data_dir, tmp_path / "copy")
    name = manifest["splits"]["train"]["shards"][-1]["filename"]
    os.remove(os.path.join(copy, name))
    with pytest.raises(DataError, match=f"{name}: shard listed in manifest.json is missing"):
        reader.make_dataset(copy, "train", batch_size=2)


# ----------------------------------------------------------------------------
# prepare errors.


def prepare_arguments(output_directory, *inputs, seq_len=SEQ_LEN, vocabulary_size=VOCABULARY_SIZE):
    return dict(
        output_directory=str(output_directory),
        inputs=[str(path) for path in inputs],
        seq_len=seq_len,
        vocabulary_size=vocabulary_size,
        shard_size=1024,
        log=lambda message: None,
    )


@pytest.mark.parametrize(
    "filename, content, message",
    [
        ("empty.txt", b"", r"empty.txt: empty input \(no non-whitespace text\)"),
        ("blank.txt", b" \n\t\n\n", r"blank.txt: empty input"),
        ("latin1.txt", b"ok\ncaf\xe9\n", r"latin1.txt:2: not valid UTF-8"),
        ("data.jsonl", b'{"text": "a"}\n\n{"text": "b"\n', r"data.jsonl:3: malformed JSON line"),
        (
            "data.jsonl",
            b'{"text": "a"}\n{"body": "b"}\n',
            r'data.jsonl:2: expected a JSON object with a string "text" field, '
            "got an object without it",
        ),
        ("data.jsonl", b'{"text": 17}\n', r"data.jsonl:1: .*got text of type int"),
        ("data.jsonl", b'["text"]\n', r"data.jsonl:1: .*got a JSON list"),
        ("data.jsonl", b'{"text": " "}\n', r"data.jsonl: empty input"),
    ],
)
def test_bad_input_files(tmp_path, filename, content, message):
    path = tmp_path / filename
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        prepare.prepare(**prepare_arguments(tmp_path / "out", path))
    assert not glob.glob(str(tmp_path / "out" / "*.tfrecord"))


def test_bad_input_paths(tmp_path):
    with pytest.raises(DataError, match=r"nothing\*.txt: no input files match this glob"):
        prepare.prepare(**prepare_arguments(tmp_path / "out", tmp_path / "nothing*.txt"))
    with pytest.raises(DataError, match="missing.txt: input file or directory not found"):
        prepare.prepare(**prepare_arguments(tmp_path / "out", tmp_path / "missing.txt"))
    (tmp_path / "empty_directory").mkdir()
    with pytest.raises(
        DataError, match=r"empty_directory: directory contains no \*.txt or \*.jsonl files"
    ):
        prepare.prepare(**prepare_arguments(tmp_path / "out", tmp_path / "empty_directory"))
    # A dangling symlink is listed by the glob but cannot be opened.
    os.symlink(tmp_path / "gone.txt", tmp_path / "link.txt")
    with pytest.raises(
        DataError, match=r"link.txt: cannot read input file \(No such file or directory\)"
    ):
        prepare.prepare(**prepare_arguments(tmp_path / "out", tmp_path / "link*.txt"))


def test_bad_arguments(corpus, tmp_path):
    text_file = corpus["inputs"][0]
    with pytest.raises(
        ValueError, match=r"`seq_len` must be an int of at least 8. Received: seq_len=4"
    ):
        prepare.prepare(**prepare_arguments(tmp_path, text_file, seq_len=4))
    with pytest.raises(
        ValueError,
        match=r"`vocabulary_size` must be an int of at least 260.*Received: vocabulary_size=200",
    ):
        prepare.prepare(**prepare_arguments(tmp_path, text_file, vocabulary_size=200))
    with pytest.raises(
        ValueError,
        match=r"`shard_size` must be an integer with an optional K, M, G or T suffix"
        r".*Received: shard_size='10X'",
    ):
        prepare.parse_size("10X", "shard_size")
    assert [prepare.parse_size(text) for text in ("64K", "10M", "1G", "2gib", "123")] == [
        64 << 10,
        10 << 20,
        1 << 30,
        2 << 30,
        123,
    ]
    with pytest.raises(
        ValueError, match=r"`val_fraction` must be in \[0, 1\). Received: val_fraction=1.0"
    ):
        prepare.prepare(**dict(prepare_arguments(tmp_path, text_file), val_fraction=1.0))


def test_corpus_too_small_for_a_validation_record(tmp_path):
    path = tmp_path / "small.txt"
    # About 2,500 tokens: enough for train records of 201 tokens, but 5% for
    # validation is only ~125 tokens.
    write_text_file(path, make_documents(200, seed=5, words_per_document=(2, 3)))
    with pytest.raises(
        DataError,
        match=r"corpus too small for --seq-len 200 and --val-fraction 0.05: "
        r"the val split got \d+ tokens",
    ):
        prepare.prepare(
            **dict(prepare_arguments(tmp_path / "out", path, seq_len=200), val_fraction=0.05)
        )
    single = tmp_path / "single.txt"
    single.write_text("one lonely document\n")
    with pytest.raises(DataError, match="corpus too small to split: all 1 document"):
        prepare.prepare(**prepare_arguments(tmp_path / "out", single))
    assert os.listdir(tmp_path / "out") == []  # Nothing left behind, not even temporaries.


def test_refuses_existing_dataset_unless_overwrite(corpus, all_train_dataset, tmp_path):
    data_dir = copy_dataset(all_train_dataset[0], tmp_path / "copy")
    with pytest.raises(
        DataError, match="output directory already contains a dataset .*pass --overwrite"
    ):
        prepare.prepare(**prepare_arguments(data_dir, *corpus["inputs"]))
    manifest = prepare.prepare(
        **dict(prepare_arguments(data_dir, *corpus["inputs"]), overwrite=True, shard_size=1 << 20)
    )
    # The old, more numerous shards are gone; only the new ones remain.
    shards = sorted(name for name in os.listdir(data_dir) if name.endswith(".tfrecord"))
    assert shards == sorted(
        shard["filename"] for split in manifest["splits"].values() for shard in split["shards"]
    )
    assert len(manifest["splits"]["train"]["shards"]) == 1


def test_reuses_an_existing_tokenizer(corpus, all_train_dataset, tmp_path):
    data_dir, manifest = all_train_dataset
    model_path = os.path.join(data_dir, "tokenizer.model")
    messages = []
    reused = prepare.prepare(
        **dict(
            prepare_arguments(tmp_path / "reused", *corpus["inputs"], vocabulary_size=None),
            tokenizer_path=model_path,
            val_fraction=0.0,
            log=messages.append,
        )
    )
    assert reused["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]
    assert reused["tokenizer"]["trained"] is False
    assert reused["splits"]["train"]["tokens"] == manifest["splits"]["train"]["tokens"]
    # Phase-end progress lines, with timings.
    for phase in ("scan done", "tokenizer done", "encode+write done", "timings:"):
        assert any(message.startswith(phase) for message in messages), phase
    with pytest.raises(
        ValueError,
        match=r"`vocabulary_size` must match the tokenizer at "
        r".*Received: vocabulary_size=500, tokenizer has 384",
    ):
        prepare.prepare(
            **dict(
                prepare_arguments(tmp_path / "mismatch", *corpus["inputs"], vocabulary_size=500),
                tokenizer_path=model_path,
            )
        )
    with pytest.raises(ValueError, match=r"`vocabulary_size` is required to train a tokenizer"):
        prepare.prepare(
            **prepare_arguments(tmp_path / "none", *corpus["inputs"], vocabulary_size=None)
        )


def test_cli_errors_print_one_line_and_exit_2(tmp_path, capsys):
    flags = ["--output", str(tmp_path / "out"), "--seq-len", "16", "--vocab-size", "300"]
    status = prepare.main(["--input", str(tmp_path / "missing.txt")] + flags)
    assert status == 2
    assert (
        capsys.readouterr().err
        == f"error: {tmp_path / 'missing.txt'}: input file or directory not found\n"
    )
    status = prepare.main(flags + ["--shard-size", "lots"])
    assert status == 2
    assert capsys.readouterr().err.startswith("error: `shard_size` must be an integer")
    # As a real process: no traceback.
    completed = subprocess.run(
        [sys.executable, "-m", "pipelines.prepare", "--input", str(tmp_path / "bad.jsonl")]
        + flags,
        capture_output=True,
        text=True,
        cwd=REPOSITORY,
    )
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert (
        completed.stderr.strip().splitlines()[-1]
        == f"error: {tmp_path / 'bad.jsonl'}: input file or directory not found"
    )


def help_entries():
    """Each flag's rendered `--help` entry (its lines), keyed by the flag's option string."""
    parser = cli.build_argument_parser()
    text = parser.format_help()
    entries = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -") and not line.startswith("   "):
            current = stripped.split()[0].rstrip(",")
            entries[current] = [stripped]
        elif current is not None and line.startswith("    ") and stripped:
            entries[current].append(stripped)
        else:
            current = None
    return parser, {flag: " ".join(lines) for flag, lines in entries.items()}


def test_help_explains_every_flag_with_its_choices_and_default():
    parser, entries = help_entries()
    flags = [action for action in parser._actions if action.option_strings != ["-h", "--help"]]
    assert len(flags) == 23
    for action in flags:
        (flag,) = action.option_strings
        entry = entries[flag]
        assert action.help and len(action.help.split()) >= 3, flag
        assert action.help.split()[0] in entry, flag
        if action.required:
            assert "default" not in entry, flag
        else:
            assert "(default: " in entry or "(required unless" in entry, (flag, entry)
        if action.default not in (None, argparse.SUPPRESS):
            assert f"(default: {action.default})" in entry, flag
    # The enumerated flags list exactly the values prepare() accepts.
    enumerated = {
        "--format": tuple(data_format.RECORD_FORMATS),
        "--tokenizer-type": ("bpe", "unigram", "wordpiece"),
        "--compression": ("none", "gzip"),
        "--too-long": data_format.TOO_LONG_CHOICES,
        "--learn": data_format.LEARN_CHOICES,
    }
    assert {action.option_strings[0] for action in flags if action.choices} == set(enumerated)
    for flag, choices in enumerated.items():
        assert entries[flag].startswith(f"{flag} {{{','.join(choices)}}}"), entries[flag]
    assert tuple(cli.COMPRESSIONS.values()) == data_format.COMPRESSIONS
    # Defaults follow the library's: the sizes read back to prepare()'s defaults.
    assert cli.parse_size(parser.get_default("shard_size")) == prepare.DEFAULT_SHARD_SIZE
    assert (
        cli.parse_size(parser.get_default("tokenizer_sample_bytes"))
        == prepare.DEFAULT_TOKENIZER_SAMPLE_BYTES
    )
    # The package docstring's examples, on their own lines (not re-wrapped), and
    # its inputs paragraph are the description; the steps are left to pydoc.
    text = parser.format_help()
    assert "\n    python -m pipelines.prepare --output data/default --seq-len 128" in text
    assert "\nInputs (`--input`, repeatable;" in text
    assert "Steps" not in text and "python -m pydoc pipelines.prepare" in text


@pytest.mark.parametrize("size", [1, 1000, 64 << 10, 3 << 20, 1 << 30, 5 << 40, (1 << 30) + 1])
def test_format_size_reads_back(size):
    text = cli.format_size(size)
    assert cli.parse_size(text) == size
    assert len(text) <= len(str(size))


def test_help_and_a_sentencepiece_run_import_no_tensorflow(corpus, tmp_path):
    """`--help`, every module of `pipelines` but the readers, and a BPE run: no TensorFlow."""
    script = textwrap.dedent("""
        import contextlib, io, runpy, sys
        import pipelines, pipelines.default_corpus, pipelines.files, pipelines.manifest
        import pipelines.sources, pipelines.tfrecord, pipelines.tokenizer
        import pipelines.wordpiece_tokenizer
        run_flags = sys.argv[1:]
        sys.argv = ["pipelines.prepare", "--help"]
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            try:
                runpy.run_module("pipelines.prepare", run_name="__main__")
            except SystemExit as exit:
                assert exit.code == 0, exit.code
        assert output.getvalue().startswith("usage: python -m pipelines.prepare"), output.getvalue()
        loaded = [name for name in sys.modules if name.split(".")[0] == "tensorflow"]
        from pipelines import prepare
        assert prepare.main(run_flags) == 0
        loaded += [name for name in sys.modules if name.split(".")[0] == "tensorflow"]
        print(sorted(loaded))
        """)
    argv = [sys.executable, "-c", script, "--output", str(tmp_path / "out"), "--workers", "2"]
    argv += ["--seq-len", str(SEQ_LEN), "--vocab-size", str(VOCABULARY_SIZE)]
    for path in corpus["inputs"]:
        argv += ["--input", path]
    completed = subprocess.run(argv, cwd=REPOSITORY, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[]"
    assert "tensorflow" not in completed.stderr.lower()  # No TensorFlow log line.
    assert os.path.exists(tmp_path / "out" / "manifest.json")
    # And `--help` itself, as users run it: nothing on stderr.
    completed = subprocess.run(
        [sys.executable, "-m", "pipelines.prepare", "--help"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0 and completed.stderr == ""
    assert "--tokenizer-type {bpe,unigram,wordpiece}" in completed.stdout


# ----------------------------------------------------------------------------
# Atomicity.


def fail_after(count, real_function):
    calls = {"count": 0}

    def failing(*arguments):
        calls["count"] += 1
        if calls["count"] > count:
            raise RuntimeError("simulated crash while writing shards")
        return real_function(*arguments)

    return failing


def test_crash_mid_write_leaves_no_final_shard_and_no_manifest(corpus, tmp_path, monkeypatch):
    # 100 records is two shards in: some shards are complete (closed,
    # fsynced) when the crash comes, and still must not appear under final names.
    writer = shard_writer.SplitWriter
    monkeypatch.setattr(writer, "_write_record", fail_after(100, writer._write_record))
    monkeypatch.setattr(
        resume, "remove_temporary_files", lambda directory: None
    )  # As after kill -9.
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare.prepare(**prepare_arguments(tmp_path, *corpus["inputs"]))
    names = os.listdir(tmp_path)
    assert not [name for name in names if not name.startswith(".")]
    assert len([name for name in names if name.endswith(".tfrecord.tmp")]) >= 2
    monkeypatch.undo()
    # The next run clears the leftovers and succeeds.
    manifest = prepare.prepare(**prepare_arguments(tmp_path, *corpus["inputs"]))
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]
    assert manifest["splits"]["train"]["sequences"] > 0


def test_failed_overwrite_keeps_the_old_dataset(corpus, all_train_dataset, tmp_path, monkeypatch):
    data_dir = copy_dataset(all_train_dataset[0], tmp_path / "copy")
    before = sorted(os.listdir(data_dir))
    writer = shard_writer.SplitWriter
    monkeypatch.setattr(writer, "_write_record", fail_after(30, writer._write_record))
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare.prepare(**dict(prepare_arguments(data_dir, *corpus["inputs"]), overwrite=True))
    assert sorted(os.listdir(data_dir)) == before
    reader.verify_shards(data_dir)


# ----------------------------------------------------------------------------
# Default corpus.


def test_default_corpus_is_large_and_deterministic():
    first = list(default_corpus.iter_documents())
    second_head = []
    second_bytes = 0
    for index, document in enumerate(default_corpus.iter_documents()):
        if index < 50:
            second_head.append(document)
        second_bytes += len(document.encode("utf-8"))
    first_bytes = sum(len(document.encode("utf-8")) for document in first)
    assert first_bytes > 1_000_000
    assert first[:50] == second_head and first_bytes == second_bytes
    assert all(document.strip() for document in first)
    # The pydoc topics come first, then docstrings (the `ast` module's own is in there).
    from pydoc_data.topics import topics

    assert first[0] == topics[sorted(topics)[0]].strip()
    import ast

    assert ast.get_docstring(ast.parse(open(ast.__file__).read())) in first
