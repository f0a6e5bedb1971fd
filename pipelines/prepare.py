"""Turn raw text into a tokenizer and sharded TFRecords: `python -m pipelines.prepare`.

Usage:

    python -m pipelines.prepare --input 'corpus/*.jsonl' --output data/pile \\
        --seq-len 1024 --vocab-size 32000
    python -m pipelines.prepare --output data/default --seq-len 128 --vocab-size 2000

Inputs (`--input`, repeatable; files, globs or directories):

- JSON Lines (`.jsonl`, `.json`): one document per line, the document is the
  line's string `text` field (the Pile's format). Blank lines are skipped.
- Anything else is plain UTF-8 text: a document is a block of consecutive
  non-blank lines; one or more blank (whitespace-only) lines separate
  documents. The lines of a block are kept verbatim (CRLF line endings
  become LF), joined with `\\n`.
- A directory contributes every `*.txt` and `*.jsonl` file below it, in sorted
  order. With no `--input`, the built-in corpus of `pipelines.default_corpus`
  (Python's pydoc topics and standard-library docstrings) is used.

Documents that are empty or whitespace-only are skipped (and counted).

Steps:

1. Scan: read every document once, validate the inputs, choose the
   validation documents and the tokenizer's training sample.
2. Tokenizer: train a SentencePiece BPE model (see `pipelines.tokenizer` for
   the special ids: pad=0, unk=1, eos=2, no bos) on a sample of at most
   `--tokenizer-sample-bytes` of training documents, or copy `--tokenizer`.
3. Encode and write: read the documents again, encode them in batches,
   append EOS to each, pack each split's token stream into records of exactly
   `seq_len + 1` tokens (non-overlapping; the reader uses `[:-1]` as inputs and
   `[1:]` as targets) and write them to shards of about `--shard-size` bytes.
   Each split's final partial record is dropped and counted.
4. Commit: rename the shards to their final names and write `manifest.json`.

Train/validation split: by document, decided by a keyed BLAKE2b hash of the
document's text and `--seed`. Documents whose hash falls in the lowest bins
go to validation, with just enough bins to hold `--val-fraction` of the
corpus's bytes (at least one document). Identical documents therefore always
land in the same split, and the split does not depend on input order.

Record format: a `tf.train.Example` with one int64 feature `input_ids` of
exactly `seq_len + 1` token ids, in TFRecord files named
`train-00000-of-00004.tfrecord` and `val-00000-of-00001.tfrecord`.

`manifest.json` keys:

- `format` ("tfgpt-packed-tokens"), `format_version` (1), `feature`
  ("input_ids"), `seq_len`, `record_length` (`seq_len + 1`).
- `tokenizer`: `type` ("sentencepiece"), `model_type`, `byte_fallback`,
  `normalization`, `add_dummy_prefix`, `model_file` ("tokenizer.model"),
  `sha256`, `vocabulary_size`, `pad_id`, `unk_id`, `bos_id`, `eos_id`,
  `eos_piece`, `trained` (false with `--tokenizer`), `source`,
  `sample_documents`, `sample_bytes`.
- `splits.train`, `splits.val`: `documents`, `tokens` (including one EOS per
  document), `sequences`, `dropped_tail_tokens`
  (`tokens = sequences * record_length + dropped_tail_tokens`), and `shards`:
  a list of `{filename, sequences, tokens, bytes, sha256}`.
- `totals`: `documents`, `input_bytes`, `skipped_empty_documents`, `tokens`,
  `sequences`, `dropped_tail_tokens`.
- `inputs` (absolute input files, or a description of the default corpus),
  `input_patterns` (as given), `seed`, `val_fraction`, `shard_size`,
  `split_rule` (the split rule in words, with its threshold).

Atomicity: shards are written as `.train-00000.tfrecord.tmp`, fsynced, and
renamed to their final names only after every shard is complete; the manifest
is written last, also via a temporary file and a rename. A crashed run never
leaves a partial shard under a final name, and a directory without
`manifest.json` is not a dataset. Errors are reported as one line
`error: ...` on stderr with exit status 2.
"""

import argparse
import glob
import hashlib
import heapq
import json
import os
import re
import sys
import time
from typing import Callable, Iterator, List, Optional, Sequence

import numpy as np

from pipelines import default_corpus
from pipelines.errors import DataError
from pipelines.tokenizer import (
    MINIMUM_VOCABULARY_SIZE,
    Tokenizer,
    _write_atomically,
    train_tokenizer,
)

FORMAT_NAME = "tfgpt-packed-tokens"
FORMAT_VERSION = 1
FEATURE_NAME = "input_ids"
MANIFEST_FILENAME = "manifest.json"
TOKENIZER_FILENAME = "tokenizer.model"
SPLITS = ("train", "val")

MINIMUM_SEQ_LEN = 8
DEFAULT_SHARD_SIZE = 1 << 30  # 1 GiB, as in the reference design.
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SEED = 0
# 64 MiB of text is plenty for vocabularies up to ~50k pieces, and SentencePiece
# needs roughly 10-20x the sample size in memory while training.
DEFAULT_TOKENIZER_SAMPLE_BYTES = 64 << 20

# The split decision uses the top 16 bits of each document's hash, so the
# validation share can be chosen to a resolution of 1/65536 of the key space.
SPLIT_HASH_BINS = 1 << 16
# Documents are encoded in batches of this many documents or bytes, whichever
# comes first, so SentencePiece's threads have work and memory stays bounded.
ENCODE_BATCH_DOCUMENTS = 1024
ENCODE_BATCH_BYTES = 8 << 20
PROGRESS_INTERVAL_SECONDS = 10.0

JSON_LINES_SUFFIXES = (".jsonl", ".json")
DIRECTORY_SUFFIXES = (".txt", ".jsonl")
_SHARD_NAME_PATTERN = re.compile(r"^(train|val)-\d{5}-of-\d{5}\.tfrecord$")
_TEMPORARY_NAME_PATTERN = re.compile(r"^\.(train|val)-\d{5}\.tfrecord\.tmp$")
_TEMPORARY_TOKENIZER_NAME = "." + TOKENIZER_FILENAME + ".tmp"
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_MULTIPLIERS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# ----------------------------------------------------------------------------
# Argument parsing and validation.


def parse_size(text: str, argument_name: str = "size") -> int:
    """Parse a byte size such as `1048576`, `64K`, `10M`, `1G`, `1GiB` or `2gb`.

    Suffixes are binary (K = 1024 bytes). Used for `--shard-size` and
    `--tokenizer-sample-bytes`.

    Args:
        text: str.
        argument_name: str. Named in the error message.

    Returns:
        int. The size in bytes, at least 1.
    """
    match = _SIZE_PATTERN.match(str(text))
    if match is None:
        raise ValueError(
            f"`{argument_name}` must be an integer with an optional K, M, G or T suffix "
            f"(binary units), e.g. 64K or 1G. Received: {argument_name}={text!r}"
        )
    size = int(match.group(1)) * _SIZE_MULTIPLIERS[match.group(2).lower()]
    if size < 1:
        raise ValueError(
            f"`{argument_name}` must be at least 1 byte. Received: {argument_name}={text!r}"
        )
    return size


def _validate_arguments(
    seq_len, vocabulary_size, shard_size, val_fraction, seed, tokenizer_sample_bytes
) -> None:
    """Raise ValueError naming the first invalid argument."""

    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    if not is_int(seq_len) or seq_len < MINIMUM_SEQ_LEN:
        raise ValueError(
            f"`seq_len` must be an int of at least {MINIMUM_SEQ_LEN}. "
            f"Received: seq_len={seq_len!r}"
        )
    if vocabulary_size is not None and (
        not is_int(vocabulary_size) or vocabulary_size < MINIMUM_VOCABULARY_SIZE
    ):
        raise ValueError(
            f"`vocabulary_size` must be an int of at least {MINIMUM_VOCABULARY_SIZE} "
            "(3 special + 256 byte-fallback pieces + 1). "
            f"Received: vocabulary_size={vocabulary_size!r}"
        )
    if not is_int(shard_size) or shard_size < 1:
        raise ValueError(
            f"`shard_size` must be a positive number of bytes. Received: shard_size={shard_size!r}"
        )
    if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"`val_fraction` must be in [0, 1). Received: val_fraction={val_fraction!r}"
        )
    if not is_int(seed) or not 0 <= seed < (1 << 63):
        raise ValueError(f"`seed` must be an int in [0, 2**63). Received: seed={seed!r}")
    if not is_int(tokenizer_sample_bytes) or tokenizer_sample_bytes < 1:
        raise ValueError(
            "`tokenizer_sample_bytes` must be a positive number of bytes. "
            f"Received: tokenizer_sample_bytes={tokenizer_sample_bytes!r}"
        )


# ----------------------------------------------------------------------------
# Inputs: resolving paths and reading documents.


def resolve_inputs(patterns: Sequence[str]) -> List[str]:
    """Expand files, globs and directories into a list of input files.

    Args:
        patterns: sequence of str. Each is a file, a glob (`*`, `?`, `[`; `**`
            recurses) or a directory (every `*.txt` and `*.jsonl` below it).

    Returns:
        list of str. Files in the order given, each glob's and directory's
        matches sorted, duplicates removed (first occurrence kept).
    """
    files = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise DataError(f"{pattern}: no input files match this glob")
        elif os.path.exists(pattern):
            matches = [pattern]
        else:
            raise DataError(f"{pattern}: input file or directory not found")
        for match in matches:
            if os.path.isdir(match):
                found = _files_in_directory(match)
                if not found:
                    raise DataError(
                        f"{match}: directory contains no "
                        f"{' or '.join('*' + suffix for suffix in DIRECTORY_SUFFIXES)} files"
                    )
                files.extend(found)
            else:
                files.append(match)
    return list(dict.fromkeys(files))


def _files_in_directory(directory: str) -> List[str]:
    found = []
    for root, subdirectories, filenames in os.walk(directory):
        subdirectories.sort()
        for filename in filenames:
            if filename.endswith(DIRECTORY_SUFFIXES):
                found.append(os.path.join(root, filename))
    return sorted(found)


def _binary_lines(path: str) -> Iterator[bytes]:
    """Yield the lines of a file, raising DataError naming it if it can't be read."""
    try:
        input_file = open(path, "rb")
    except OSError as error:
        raise DataError(f"{path}: cannot read input file ({error.strerror})") from None
    with input_file:
        try:
            yield from input_file
        except OSError as error:
            raise DataError(f"{path}: cannot read input file ({error.strerror})") from None


def _decode_line(path: str, line_number: int, line: bytes) -> str:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path}:{line_number}: not valid UTF-8 (byte {error.start} of the line)"
        ) from None
    if line_number == 1 and text.startswith("\ufeff"):
        text = text[1:]  # A UTF-8 byte order mark is not part of the text.
    return text


def read_text_documents(path: str, counters: dict) -> Iterator[str]:
    """Yield the blank-line-separated documents of a plain UTF-8 text file.

    Args:
        path: str.
        counters: dict. `counters["empty_documents"]` is not touched (blank
            lines only separate documents, they never form one).

    Yields:
        str. Each block of non-blank lines, joined with `\\n`.
    """
    block = []
    number_of_documents = 0
    for line_number, raw_line in enumerate(_binary_lines(path), start=1):
        line = _decode_line(path, line_number, raw_line).rstrip("\n").rstrip("\r")
        if line.strip():
            block.append(line)
        elif block:
            number_of_documents += 1
            yield "\n".join(block)
            block = []
    if block:
        number_of_documents += 1
        yield "\n".join(block)
    if number_of_documents == 0:
        raise DataError(f"{path}: empty input (no non-whitespace text)")


def read_json_lines_documents(path: str, counters: dict) -> Iterator[str]:
    """Yield the `text` field of each line of a JSON Lines file.

    Args:
        path: str.
        counters: dict. `counters["empty_documents"]` is incremented for each
            whitespace-only `text`.

    Yields:
        str. One document per non-blank line.
    """
    number_of_documents = 0
    for line_number, raw_line in enumerate(_binary_lines(path), start=1):
        line = _decode_line(path, line_number, raw_line)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path}:{line_number}: malformed JSON line ({error.msg}: column {error.colno})"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            if not isinstance(record, dict):
                received = f"a JSON {type(record).__name__}"
            elif "text" not in record:
                received = f"an object without it (keys: {sorted(record)[:5]})"
            else:
                received = f"text of type {type(record['text']).__name__}"
            raise DataError(
                f'{path}:{line_number}: expected a JSON object with a string "text" '
                f"field, got {received}"
            )
        text = record["text"]
        if not text.strip():
            counters["empty_documents"] += 1
            continue
        number_of_documents += 1
        yield text
    if number_of_documents == 0:
        raise DataError(f"{path}: empty input (no non-whitespace text)")


class Corpus:
    """The documents of a list of input files, or the built-in default corpus.

    Iterating twice yields the same documents (prepare reads the corpus twice).

    Args:
        files: list of str or None. Input files from `resolve_inputs`; None
            selects `pipelines.default_corpus`.
    """

    def __init__(self, files: Optional[List[str]]):
        self.files = files
        self.counters = {"empty_documents": 0}
        # The default corpus is small (a few MB) and slow to produce (it parses
        # the whole standard library), so it is kept after the first pass.
        self._default_documents = None

    def description(self) -> List[str]:
        """list of str. The inputs, as recorded in the manifest."""
        if self.files is None:
            return [default_corpus.describe()]
        return [os.path.abspath(path) for path in self.files]

    def __iter__(self) -> Iterator[str]:
        self.counters["empty_documents"] = 0
        if self.files is None:
            if self._default_documents is None:
                self._default_documents = list(default_corpus.iter_documents())
            for document in self._default_documents:
                if document.strip():
                    yield document
                else:
                    self.counters["empty_documents"] += 1
            return
        for path in self.files:
            if path.endswith(JSON_LINES_SUFFIXES):
                yield from read_json_lines_documents(path, self.counters)
            else:
                yield from read_text_documents(path, self.counters)


# ----------------------------------------------------------------------------
# Pass 1: scan the corpus, choose the validation documents and tokenizer sample.


def _document_digest(document_bytes: bytes, seed: int) -> bytes:
    """16-byte keyed hash; bytes 0-1 pick the split bin, bytes 8-15 the sample key."""
    return hashlib.blake2b(document_bytes, digest_size=16, key=seed.to_bytes(8, "little")).digest()


def _split_bin(digest: bytes) -> int:
    return int.from_bytes(digest[:2], "big")


class _ByteBudgetSampler:
    """Keep the documents with the smallest random keys that fit a byte budget.

    A uniform sample of documents without replacement (bottom-k sampling with
    a byte budget instead of k), in one pass and bounded memory. A document
    larger than the whole budget is truncated to it.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.total_bytes = 0
        self._heap = []  # Max-heap on the key via negation: (-key, text, bytes, bin).

    def offer(self, key: int, text: str, size: int, split_bin: int) -> None:
        if size > self.budget_bytes:
            text = text.encode("utf-8")[: self.budget_bytes].decode("utf-8", "ignore")
            size = len(text.encode("utf-8"))
        if self._heap and self.total_bytes + size > self.budget_bytes:
            if key > -self._heap[0][0]:
                return  # Larger key than everything kept, and no room.
        heapq.heappush(self._heap, (-key, text, size, split_bin))
        self.total_bytes += size
        while self.total_bytes > self.budget_bytes:
            _, _, removed_size, _ = heapq.heappop(self._heap)
            self.total_bytes -= removed_size

    def documents(self, exclude_bins_below: int) -> List[str]:
        """The kept documents in key order, minus those in validation bins."""
        kept = sorted(self._heap, reverse=True)  # Ascending key.
        return [text for _, text, _, split_bin in kept if split_bin >= exclude_bins_below]


def _validation_bin_threshold(histogram: List[int], val_fraction: float) -> int:
    """Smallest number of leading bins holding at least `val_fraction` of the bytes."""
    if val_fraction <= 0.0:
        return 0
    target = val_fraction * sum(histogram)
    cumulative = 0
    for bin_index, size in enumerate(histogram):
        cumulative += size
        if cumulative >= target and cumulative > 0:
            return bin_index + 1
    return len(histogram)


class _Progress:
    """Periodic `documents, MB, MB/s` lines on stderr for one phase."""

    def __init__(self, phase: str, log: Callable[[str], None]):
        self.phase = phase
        self.log = log
        self.start = time.perf_counter()
        self._last_report = self.start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, documents: int, size: int, extra: str = "") -> None:
        now = time.perf_counter()
        if now - self._last_report >= PROGRESS_INTERVAL_SECONDS:
            self._last_report = now
            self.log(f"{self.phase}: {self._rates(documents, size)}{extra}")

    def _rates(self, documents: int, size: int) -> str:
        elapsed = max(self.elapsed(), 1e-9)
        return (
            f"{documents:,} documents, {size / 1e6:,.1f} MB, " f"{size / 1e6 / elapsed:,.1f} MB/s"
        )

    def done(self, documents: int, size: int, extra: str = "") -> None:
        self.log(
            f"{self.phase} done: {self._rates(documents, size)}{extra} "
            f"in {self.elapsed():.1f} s"
        )


def _scan(corpus, seed, val_fraction, sample_bytes, collect_sample, log):
    """Pass 1. Returns a dict of counts, the validation threshold and the sample."""
    progress = _Progress("scan", log)
    histogram = [0] * SPLIT_HASH_BINS
    sampler = _ByteBudgetSampler(sample_bytes)
    documents = 0
    total_bytes = 0
    for text in corpus:
        data = text.encode("utf-8")
        digest = _document_digest(data, seed)
        split_bin = _split_bin(digest)
        histogram[split_bin] += len(data)
        if collect_sample:
            sampler.offer(int.from_bytes(digest[8:], "big"), text, len(data), split_bin)
        documents += 1
        total_bytes += len(data)
        progress.update(documents, total_bytes)
    if documents == 0:
        raise DataError("the input has no non-whitespace documents")
    threshold = _validation_bin_threshold(histogram, val_fraction)
    validation_bytes = sum(histogram[:threshold])
    if threshold > 0 and validation_bytes == total_bytes:
        raise DataError(
            f"corpus too small to split: all {documents} document(s) would go to the "
            f"validation split with --val-fraction {val_fraction}; add documents or "
            "use --val-fraction 0"
        )
    progress.done(
        documents,
        total_bytes,
        f"; validation gets {validation_bytes / max(total_bytes, 1):.1%} of the bytes",
    )
    return {
        "documents": documents,
        "bytes": total_bytes,
        "validation_bin_threshold": threshold,
        "sample": sampler.documents(exclude_bins_below=threshold) if collect_sample else [],
        "seconds": progress.elapsed(),
    }


# ----------------------------------------------------------------------------
# Pass 2: encode, pack and write shards.


def _varint(value: int) -> bytes:
    """Protocol-buffer base-128 varint of a non-negative int."""
    encoded = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            encoded.append(byte | 0x80)
        else:
            encoded.append(byte)
            return bytes(encoded)


def _length_delimited(field_tag: int, payload: bytes) -> bytes:
    return bytes([field_tag]) + _varint(len(payload)) + payload


_FEATURE_KEY = _length_delimited(0x0A, FEATURE_NAME.encode("ascii"))  # MapEntry.key = 1


def serialize_records(records: np.ndarray) -> List[bytes]:
    """Serialize records as `tf.train.Example`s with one int64 feature `input_ids`.

    Byte-for-byte what protobuf produces for
    `Example(features=Features(feature={"input_ids": Feature(int64_list=Int64List(value=ids))}))`
    (the tests compare against protobuf), but vectorized with NumPy: building
    one protobuf message per record in Python costs more than the encoding.

    Args:
        records: int array of shape (number_of_records, record_length), with
            non-negative values (token ids).

    Returns:
        list of bytes, one serialized Example per record.
    """
    records = np.asarray(records)
    if records.ndim != 2:
        raise ValueError(f"`records` must be 2-D. Received: shape {records.shape}")
    if records.size and records.min() < 0:
        raise ValueError(f"`records` must be non-negative. Received: minimum {records.min()}")
    values = records.astype(np.int64, copy=False)  # (N, R)
    largest = int(values.max()) if values.size else 0
    maximum_bytes = max(1, (largest.bit_length() + 6) // 7)
    # Varint length of every value: 1 byte per started group of 7 bits.
    byte_counts = np.ones(values.shape, dtype=np.int64)  # (N, R)
    for group in range(1, maximum_bytes):
        byte_counts += values >= (1 << (7 * group))
    varint_bytes = np.empty(values.shape + (maximum_bytes,), dtype=np.uint8)  # (N, R, B)
    for group in range(maximum_bytes):
        low_bits = (values >> (7 * group)) & 0x7F
        continuation = (byte_counts > group + 1) * 0x80
        varint_bytes[:, :, group] = low_bits | continuation
    used = np.arange(maximum_bytes) < byte_counts[:, :, None]  # (N, R, B)
    # Boolean indexing keeps row-major order: record by record, value by value.
    packed = varint_bytes[used].tobytes()
    ends = np.cumsum(byte_counts.sum(axis=1)).tolist()  # (N,)
    serialized = []
    start = 0
    for end in ends:
        int64_list = _length_delimited(0x0A, packed[start:end])  # Int64List.value = 1, packed
        feature = _length_delimited(0x1A, int64_list)  # Feature.int64_list = 3
        map_entry = _FEATURE_KEY + _length_delimited(0x12, feature)  # MapEntry.value = 2
        features = _length_delimited(0x0A, map_entry)  # Features.feature = 1
        serialized.append(_length_delimited(0x0A, features))  # Example.features = 1
        start = end
    return serialized


def _sha256_and_fsync(path: str) -> str:
    """Hash a closed file and force it to disk (TFRecordWriter cannot fsync)."""
    digest = hashlib.sha256()
    file_descriptor = os.open(path, os.O_RDONLY)
    try:
        while True:
            chunk = os.read(file_descriptor, 8 << 20)
            if not chunk:
                break
            digest.update(chunk)
        # fsync applies to the file, not the descriptor, so a read-only
        # descriptor opened after TFRecordWriter closed it is enough on Linux.
        os.fsync(file_descriptor)
    finally:
        os.close(file_descriptor)
    return digest.hexdigest()


def _write_and_fsync(path: str, data: bytes) -> None:
    with open(path, "wb") as output_file:
        output_file.write(data)
        output_file.flush()
        os.fsync(output_file.fileno())


def _fsync_directory(directory: str) -> None:
    """Make renames in `directory` durable."""
    file_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(file_descriptor)
    finally:
        os.close(file_descriptor)


class _SplitWriter:
    """Packs one split's token stream into records and rolls shards by size.

    Args:
        split: str. "train" or "val".
        directory: str. The output directory.
        record_length: int. Tokens per record (`seq_len + 1`).
        shard_size: int. A shard is closed before a record would take it past
            this many bytes (a shard always holds at least one record).
    """

    # TFRecord framing per record: uint64 length, uint32 length CRC, uint32 data CRC.
    FRAMING_BYTES = 16

    def __init__(self, split: str, directory: str, record_length: int, shard_size: int):
        self.split = split
        self.directory = directory
        self.record_length = record_length
        self.shard_size = shard_size
        self.shards = []  # dicts: temporary_path, sequences, tokens, bytes, sha256.
        self.documents = 0
        self.tokens = 0
        self._carry = np.zeros((0,), dtype=np.int64)
        self._writer = None
        self._current = None

    def add_documents(self, token_lists: List[List[int]], eos_id: int) -> None:
        """Append documents (each followed by EOS) to the stream; write full records."""
        if not token_lists:
            return
        stream = []
        for token_ids in token_lists:
            stream.extend(token_ids)
            stream.append(eos_id)
        self.documents += len(token_lists)
        self.tokens += len(stream)
        stream = np.concatenate([self._carry, np.asarray(stream, dtype=np.int64)])
        number_of_records = len(stream) // self.record_length
        records = stream[: number_of_records * self.record_length].reshape(
            number_of_records, self.record_length
        )  # (records, seq_len + 1)
        self._carry = stream[number_of_records * self.record_length :].copy()
        for serialized in serialize_records(records):
            self._write_record(serialized)

    def _write_record(self, serialized: bytes) -> None:
        size = len(serialized) + self.FRAMING_BYTES
        if self._current is not None and self._current["bytes"] + size > self.shard_size:
            self._close_shard()
        if self._current is None:
            self._open_shard()
        self._writer.write(serialized)
        self._current["bytes"] += size
        self._current["sequences"] += 1
        self._current["tokens"] += self.record_length

    def _open_shard(self) -> None:
        import tensorflow as tf

        name = f".{self.split}-{len(self.shards):05d}.tfrecord.tmp"
        path = os.path.join(self.directory, name)
        self._current = {"temporary_path": path, "sequences": 0, "tokens": 0, "bytes": 0}
        self.shards.append(self._current)
        self._writer = tf.io.TFRecordWriter(path)

    def _close_shard(self) -> None:
        self._writer.close()
        self._writer = None
        path = self._current["temporary_path"]
        actual_size = os.path.getsize(path)
        if actual_size != self._current["bytes"]:
            raise RuntimeError(
                f"{path}: wrote {actual_size} bytes, expected {self._current['bytes']}"
            )
        self._current["sha256"] = _sha256_and_fsync(path)
        self._current = None

    def close(self) -> None:
        """Close the last shard. The partial record left over is dropped."""
        if self._current is not None:
            self._close_shard()

    def abort(self) -> None:
        """Close the open writer without finishing (used on errors)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # Already failing; the original error matters.
                pass
            self._writer = None

    @property
    def sequences(self) -> int:
        return sum(shard["sequences"] for shard in self.shards)

    @property
    def dropped_tail_tokens(self) -> int:
        return len(self._carry)


def _encode_and_write(corpus, tokenizer, writers, seed, threshold, num_threads, log):
    """Pass 2. Encodes documents in batches and routes them to their split."""
    progress = _Progress("encode+write", log)
    documents = 0
    total_bytes = 0
    batch_texts, batch_splits, batch_bytes = [], [], 0

    def flush():
        token_lists = tokenizer.encode_batch(batch_texts, num_threads=num_threads)
        for split in SPLITS:
            selected = [
                token_ids
                for token_ids, document_split in zip(token_lists, batch_splits)
                if document_split == split
            ]
            if split in writers:
                writers[split].add_documents(selected, tokenizer.eos_id)

    for text in corpus:
        data = text.encode("utf-8")
        split = "val" if _split_bin(_document_digest(data, seed)) < threshold else "train"
        batch_texts.append(text)
        batch_splits.append(split)
        batch_bytes += len(data)
        documents += 1
        total_bytes += len(data)
        if len(batch_texts) >= ENCODE_BATCH_DOCUMENTS or batch_bytes >= ENCODE_BATCH_BYTES:
            flush()
            batch_texts, batch_splits, batch_bytes = [], [], 0
            tokens = sum(writer.tokens for writer in writers.values())
            progress.update(documents, total_bytes, f", {tokens:,} tokens")
    if batch_texts:
        flush()
    for writer in writers.values():
        writer.close()
    tokens = sum(writer.tokens for writer in writers.values())
    progress.done(
        documents,
        total_bytes,
        f", {tokens:,} tokens ({tokens / max(progress.elapsed(), 1e-9):,.0f} tokens/s)",
    )
    return {"documents": documents, "bytes": total_bytes, "seconds": progress.elapsed()}


# ----------------------------------------------------------------------------
# Output directory handling and the commit step.


def _existing_dataset_files(directory: str) -> List[str]:
    return sorted(
        name
        for name in os.listdir(directory)
        if _SHARD_NAME_PATTERN.match(name) or name == MANIFEST_FILENAME
    )


def _remove_temporary_files(directory: str) -> None:
    """Delete temporary files left by this run or by an earlier crashed run."""
    for name in os.listdir(directory):
        if _TEMPORARY_NAME_PATTERN.match(name) or name == _TEMPORARY_TOKENIZER_NAME:
            os.remove(os.path.join(directory, name))


def _final_shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def _commit(directory: str, writers: dict, manifest: dict) -> None:
    """Move temporaries to final names, then write the manifest last."""
    # Remove the old manifest first: from here until the new one is written the
    # directory is, correctly, not a dataset.
    manifest_path = os.path.join(directory, MANIFEST_FILENAME)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)
    for name in _existing_dataset_files(directory):
        os.remove(os.path.join(directory, name))
    _fsync_directory(directory)
    os.replace(
        os.path.join(directory, _TEMPORARY_TOKENIZER_NAME),
        os.path.join(directory, TOKENIZER_FILENAME),
    )
    for split, writer in writers.items():
        for index, shard in enumerate(writer.shards):
            final_name = _final_shard_name(split, index, len(writer.shards))
            os.replace(shard["temporary_path"], os.path.join(directory, final_name))
    _fsync_directory(directory)
    _write_atomically(manifest_path, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    _fsync_directory(directory)


def _split_summary(writer: Optional[_SplitWriter]) -> dict:
    if writer is None:
        return {"documents": 0, "tokens": 0, "sequences": 0, "dropped_tail_tokens": 0, "shards": []}
    count = len(writer.shards)
    return {
        "documents": writer.documents,
        "tokens": writer.tokens,
        "sequences": writer.sequences,
        "dropped_tail_tokens": writer.dropped_tail_tokens,
        "shards": [
            {
                "filename": _final_shard_name(writer.split, index, count),
                "sequences": shard["sequences"],
                "tokens": shard["tokens"],
                "bytes": shard["bytes"],
                "sha256": shard["sha256"],
            }
            for index, shard in enumerate(writer.shards)
        ],
    }


def _build_manifest(
    *,
    writers,
    tokenizer,
    tokenizer_path,
    sample_documents,
    sample_bytes,
    scan,
    corpus,
    inputs,
    seq_len,
    seed,
    val_fraction,
    shard_size,
) -> dict:
    """The manifest's contents; see the module docstring for the keys."""
    record_length = seq_len + 1
    splits = {split: _split_summary(writers.get(split)) for split in SPLITS}
    tokenizer_sha256 = hashlib.sha256(tokenizer.model_proto).hexdigest()
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "feature": FEATURE_NAME,
        "seq_len": seq_len,
        "record_length": record_length,
        "tokenizer": {
            "type": "sentencepiece",
            **tokenizer.settings(),
            "model_file": TOKENIZER_FILENAME,
            "sha256": tokenizer_sha256,
            "vocabulary_size": tokenizer.vocabulary_size,
            "pad_id": tokenizer.pad_id,
            "unk_id": tokenizer.unk_id,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            "eos_piece": tokenizer.id_to_piece(tokenizer.eos_id),
            "trained": tokenizer_path is None,
            "source": None if tokenizer_path is None else os.path.abspath(tokenizer_path),
            "sample_documents": None if tokenizer_path else sample_documents,
            "sample_bytes": None if tokenizer_path else sample_bytes,
        },
        "splits": splits,
        "totals": {
            "documents": scan["documents"],
            "input_bytes": scan["bytes"],
            "skipped_empty_documents": corpus.counters["empty_documents"],
            "tokens": sum(split["tokens"] for split in splits.values()),
            "sequences": sum(split["sequences"] for split in splits.values()),
            "dropped_tail_tokens": sum(split["dropped_tail_tokens"] for split in splits.values()),
        },
        "inputs": corpus.description(),
        "input_patterns": None if inputs is None else list(inputs),
        "seed": seed,
        "val_fraction": val_fraction,
        "shard_size": shard_size,
        "split_rule": (
            "document to val iff the top 16 bits of blake2b(text, key=seed as 8 "
            f"little-endian bytes, digest_size=16) < {scan['validation_bin_threshold']}"
        ),
    }
    return manifest


def _stderr_log(message: str) -> None:
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def prepare(
    output_directory: str,
    inputs: Optional[Sequence[str]] = None,
    *,
    seq_len: int,
    vocabulary_size: Optional[int] = None,
    tokenizer_path: Optional[str] = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = DEFAULT_SEED,
    tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES,
    overwrite: bool = False,
    num_threads: Optional[int] = None,
    log: Callable[[str], None] = _stderr_log,
) -> dict:
    """Build a tfgpt data directory from raw text. The CLI calls this.

    Args:
        output_directory: str. Created if missing. Must not already hold
            shards or a manifest unless `overwrite=True`.
        inputs: sequence of str or None. Files, globs or directories (see the
            module docstring); None uses `pipelines.default_corpus`.
        seq_len: int. Model context length; records hold `seq_len + 1` tokens.
            At least `MINIMUM_SEQ_LEN` (8).
        vocabulary_size: int or None. Size of the tokenizer to train. Required
            unless `tokenizer_path` is given (then it must match, if given).
        tokenizer_path: str or None. An existing SentencePiece model to reuse
            instead of training one. It must define an EOS piece.
        shard_size: int. Target shard size in bytes (default 1 GiB).
        val_fraction: float. Share of the corpus's bytes, in [0, 1), that goes
            to the validation split, by whole documents. 0 writes no val split.
        seed: int. Keys the document hash that decides splits and the
            tokenizer sample.
        tokenizer_sample_bytes: int. Cap on the training documents' bytes
            used to train the tokenizer (default 64 MiB).
        overwrite: bool. Replace an existing dataset in `output_directory`.
        num_threads: int or None. SentencePiece threads; None uses every core.
        log: callable taking a str. Progress sink (stderr by default).

    Returns:
        dict. The manifest, as written to `manifest.json`.
    """
    _validate_arguments(
        seq_len, vocabulary_size, shard_size, val_fraction, seed, tokenizer_sample_bytes
    )
    if vocabulary_size is None and tokenizer_path is None:
        raise ValueError(
            "`vocabulary_size` is required to train a tokenizer (or pass `tokenizer_path`). "
            "Received: vocabulary_size=None, tokenizer_path=None"
        )
    if inputs is not None and len(inputs) == 0:
        raise ValueError("`inputs` must be None (default corpus) or non-empty. Received: []")
    files = None if inputs is None else resolve_inputs(inputs)
    tokenizer = None
    if tokenizer_path is not None:
        tokenizer = Tokenizer.load(tokenizer_path)
        if tokenizer.eos_id < 0:
            raise ValueError(f"{tokenizer_path}: the tokenizer has no EOS piece (eos_id=-1)")
        if vocabulary_size is not None and vocabulary_size != tokenizer.vocabulary_size:
            raise ValueError(
                f"`vocabulary_size` must match the tokenizer at {tokenizer_path}. "
                f"Received: vocabulary_size={vocabulary_size}, tokenizer has "
                f"{tokenizer.vocabulary_size}"
            )

    if os.path.exists(output_directory) and not os.path.isdir(output_directory):
        raise DataError(f"{output_directory}: output path exists and is not a directory")
    os.makedirs(output_directory, exist_ok=True)
    existing = _existing_dataset_files(output_directory)
    if existing and not overwrite:
        raise DataError(
            f"{output_directory}: output directory already contains a dataset "
            f"({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}); "
            "pass --overwrite to replace it"
        )
    _remove_temporary_files(output_directory)

    corpus = Corpus(files)
    if files is None:
        log(f"no --input: using {default_corpus.describe()}")
    else:
        log(f"{len(files)} input file(s): {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}")
    timings = {}
    start = time.perf_counter()
    # Imported here, once inputs are known to be valid, so that its seconds of
    # start-up are reported on their own and not billed to a phase.
    import tensorflow  # noqa: F401

    timings["import_tensorflow_seconds"] = time.perf_counter() - start
    writers = {}
    try:
        scan = _scan(corpus, seed, val_fraction, tokenizer_sample_bytes, tokenizer is None, log)
        timings["scan_seconds"] = scan["seconds"]

        start = time.perf_counter()
        temporary_tokenizer_path = os.path.join(output_directory, _TEMPORARY_TOKENIZER_NAME)
        sample = scan.pop("sample")
        sample_bytes = sum(len(text.encode("utf-8")) for text in sample)
        if tokenizer is None:
            log(
                f"tokenizer: training SentencePiece BPE, vocabulary_size={vocabulary_size}, "
                f"on {len(sample):,} documents ({sample_bytes / 1e6:,.1f} MB)"
            )
            tokenizer = train_tokenizer(sample, vocabulary_size, None, num_threads=num_threads)
        _write_and_fsync(temporary_tokenizer_path, tokenizer.model_proto)
        sample_documents = len(sample)
        del sample
        timings["tokenizer_seconds"] = time.perf_counter() - start
        log(f"tokenizer done in {timings['tokenizer_seconds']:.1f} s")

        record_length = seq_len + 1
        for split in SPLITS:
            if split == "train" or val_fraction > 0:
                writers[split] = _SplitWriter(split, output_directory, record_length, shard_size)
        encoded = _encode_and_write(
            corpus, tokenizer, writers, seed, scan["validation_bin_threshold"], num_threads, log
        )
        timings["encode_and_write_seconds"] = encoded["seconds"]
        if (encoded["documents"], encoded["bytes"]) != (scan["documents"], scan["bytes"]):
            raise DataError(
                "the input changed while being prepared: first pass read "
                f"{scan['documents']} documents / {scan['bytes']} bytes, second pass "
                f"{encoded['documents']} / {encoded['bytes']}"
            )
        for split, writer in writers.items():
            if writer.sequences == 0:
                raise DataError(
                    f"corpus too small for --seq-len {seq_len} and --val-fraction "
                    f"{val_fraction}: the {split} split got {writer.tokens:,} tokens from "
                    f"{writer.documents:,} document(s), but one record needs "
                    f"{record_length}; add text, lower --seq-len"
                    + (" or raise --val-fraction" if split == "val" else "")
                )

        manifest = _build_manifest(
            writers=writers,
            tokenizer=tokenizer,
            tokenizer_path=tokenizer_path,
            sample_documents=sample_documents,
            sample_bytes=sample_bytes,
            scan=scan,
            corpus=corpus,
            inputs=inputs,
            seq_len=seq_len,
            seed=seed,
            val_fraction=val_fraction,
            shard_size=shard_size,
        )
        start = time.perf_counter()
        _commit(output_directory, writers, manifest)
        timings["commit_seconds"] = time.perf_counter() - start
    except BaseException:
        for writer in writers.values():
            writer.abort()
        _remove_temporary_files(output_directory)
        raise

    for split in SPLITS:
        summary = manifest["splits"][split]
        log(
            f"{split}: {len(summary['shards'])} shard(s), {summary['sequences']:,} sequences, "
            f"{summary['tokens']:,} tokens from {summary['documents']:,} documents, "
            f"{summary['dropped_tail_tokens']:,} tail tokens dropped"
        )
    log(
        "timings: "
        + ", ".join(
            f"{name.replace('_seconds', '')} {seconds:.1f} s" for name, seconds in timings.items()
        )
        + f"; wrote {os.path.join(output_directory, MANIFEST_FILENAME)}"
    )
    return manifest


def _build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.prepare",
        description=(
            "Train a SentencePiece BPE tokenizer and write packed, sharded TFRecords "
            "(train/val) plus manifest.json. Plain-text inputs: one document per block "
            "of non-blank lines (blank lines separate documents). JSON Lines inputs "
            "(.jsonl/.json): one document per line, its string 'text' field. "
            "Directories: every *.txt and *.jsonl below them. Without --input, Python's "
            "own documentation (pydoc topics + standard-library docstrings) is the corpus."
        ),
    )
    parser.add_argument(
        "--input",
        action="append",
        dest="inputs",
        metavar="PATH_OR_GLOB",
        help="input file, glob or directory; repeat for several (default: built-in corpus)",
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="output data directory")
    parser.add_argument(
        "--seq-len",
        type=int,
        required=True,
        help=f"tokens per training example (>= {MINIMUM_SEQ_LEN}); records hold seq_len + 1",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help=(
            f"tokenizer vocabulary size (>= {MINIMUM_VOCABULARY_SIZE}); "
            "required unless --tokenizer"
        ),
    )
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="reuse this SentencePiece model instead of training one"
    )
    parser.add_argument(
        "--shard-size",
        default="1G",
        help="target shard size, e.g. 64K, 10M, 1G (binary units; default 1G)",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=(
            "share of the bytes, by whole documents, for validation "
            f"(default {DEFAULT_VAL_FRACTION})"
        ),
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"split/sample seed (default {DEFAULT_SEED})"
    )
    parser.add_argument(
        "--tokenizer-sample-bytes",
        default="64M",
        help="cap on the text used to train the tokenizer (default 64M)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing dataset in --output"
    )
    parser.add_argument(
        "--num-threads", type=int, help="SentencePiece threads (default: all cores)"
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point. Returns the exit status (0, or 2 on bad input).

    Args:
        argv: sequence of str or None. Arguments without the program name;
            None reads `sys.argv[1:]`.
    """
    arguments = _build_argument_parser().parse_args(argv)
    try:
        prepare(
            arguments.output,
            arguments.inputs,
            seq_len=arguments.seq_len,
            vocabulary_size=arguments.vocab_size,
            tokenizer_path=arguments.tokenizer,
            shard_size=parse_size(arguments.shard_size, "shard_size"),
            val_fraction=arguments.val_fraction,
            seed=arguments.seed,
            tokenizer_sample_bytes=parse_size(
                arguments.tokenizer_sample_bytes, "tokenizer_sample_bytes"
            ),
            overwrite=arguments.overwrite,
            num_threads=arguments.num_threads,
        )
    except (ValueError, OSError) as error:
        message = (
            str(error)
            if not isinstance(error, OSError)
            else (f"{error.filename}: {error.strerror}" if error.filename else str(error))
        )
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
