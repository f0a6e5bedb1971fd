"""Turn raw text into a tokenizer and sharded TFRecords: `python -m pipelines.prepare`.

Usage:

    python -m pipelines.prepare --input 'pile/train/*.jsonl.zst' --output data/pile \\
        --seq-len 2048 --vocab-size 50000 --workers 64
    python -m pipelines.prepare --output data/default --seq-len 128 --vocab-size 2000
    python -m pipelines.prepare --input wiki/ --output data/bert --format encoder \\
        --seq-len 128 --tokenizer-type wordpiece --vocab-size 30000

Inputs (`--input`, repeatable; files, globs or directories; see
`pipelines.sources`): plain text (documents separated by blank lines), JSON
Lines with a string `text` field (`--text-key`), the Pile's `.jsonl.zst`
(streamed), and TensorFlow Datasets splits (`--tfds NAME[:SPLIT]` with
`--tfds-data-dir`, already prepared; nothing is downloaded). With no input,
the built-in corpus of `pipelines.default_corpus`. Whitespace-only
documents are skipped and counted.

Steps:

1. Plan: the inputs are cut into chunks of about `--chunk-size` bytes
   (default: twice `--shard-size`, at least 64 MiB). A chunk is the unit of
   parallel work and of resuming; chunking depends only on the inputs.
2. Scan (parallel over chunks): hash every document to choose the
   validation documents and the tokenizer's training sample.
3. Tokenizer: train SentencePiece BPE or unigram (byte fallback, see
   `pipelines.tokenizer`: pad=0, unk=1, eos=2, no bos; with `--format
   encoder` also [CLS]=3, [SEP]=4, [MASK]=5) or WordPiece
   (`pipelines.wordpiece_tokenizer`, same special ids) on a sample of at most
   `--tokenizer-sample-bytes` (default 64 MiB) of training documents: the
   documents with the smallest keyed hashes that fit the budget, a uniform
   sample independent of input order. Or reuse `--tokenizer` (a model file,
   a `vocab.txt` or a directory holding one, e.g. an earlier data directory).
4. Encode and write (parallel over chunks, `--workers` processes): each
   chunk's documents are encoded in batches and written to that chunk's own
   shards, rolled at `--shard-size` bytes (uncompressed). A split therefore
   has at least one shard per chunk: validation shards hold about
   `--val-fraction` of a chunk each.
5. Commit: the shards are renamed to `{split}-{index:05d}-of-{count:05d}.tfrecord`
   in chunk order, and `manifest.json` is written last.

Record formats (`--format`):

- `packed` (GPT, default): each split's token stream (documents, each
  followed by EOS) is cut into records of exactly `seq_len + 1` tokens, a
  `tf.train.Example` with one int64 feature `input_ids`; the reader uses
  `[:-1]` as inputs and `[1:]` as targets. Each chunk's partial last
  record is dropped and counted (`dropped_tail_tokens`, under `seq_len + 1`
  tokens per chunk and split).
- `encoder` (BERT/ALBERT): documents are cut into segments (lines, then
  sentences: a `.`, `!` or `?` followed by white space), each segment is
  encoded, and consecutive segments of one document are grouped greedily
  into records of at most `seq_len - 3` tokens (room for [CLS] A [SEP] B
  [SEP]); a longer segment is cut. A record is an Example with int64
  features `token_ids` (the segments back to back) and `segment_lengths`;
  records of fewer than 2 tokens are dropped and counted. The reader
  (`pipelines.encoder_data`) builds the A/B pairs, sentence-order or
  next-sentence labels and masks, freshly each epoch.

Determinism: the same inputs, flags and seed give byte-identical shards,
whatever `--workers` (each chunk is encoded on its own; the order of
documents, chunks and shards is fixed). Optional `--compression gzip`
writes GZIP TFRecords with a fixed header (still byte-identical).

Train/validation split: by document, decided by a keyed BLAKE2b hash of
the document's text and `--seed`. Documents whose hash falls in the lowest
bins go to validation, with just enough bins to hold `--val-fraction` of the
corpus's bytes (at least one document). Identical documents always land in
the same split, and no document is in both.

Parallelism and memory: `--workers` processes (default: every core) each
read, encode and write whole chunks; TensorFlow is not imported for
SentencePiece tokenizers (records are framed by `pipelines.tfrecord`).
Memory is bounded independently of the corpus size. Encoding holds per
worker one batch of at most 512 KiB of text (`ENCODE_BATCH_BYTES`) and its
token ids, and streams shards to disk; the main process keeps only
per-chunk counts. With a given SentencePiece tokenizer that is under
`MEMORY_BOUND_MB` (60 MB) of peak resident memory per process, Python and
NumPy included (tests/test_pipelines_scale.py checks it on a 64 MB
corpus). Training a tokenizer adds the sample: the scan holds at most
`(workers + 2) x --tokenizer-sample-bytes` of sampled text plus a 512 KiB
histogram per worker, and SentencePiece training needs roughly 10-20x the
sample. The largest single document must also fit. (WordPiece adds
TensorFlow, about 0.6 GB, per worker.)

Resuming: `.prepare-state.json` in the output directory records the scan's
results, the tokenizer and every finished chunk's shards with their SHA-256.
Rerunning the same command after a crash, `kill -9` or Ctrl-C re-verifies
those shards' checksums, keeps the intact ones and encodes only the other
chunks, so no document is duplicated or dropped and the result is identical
to an uninterrupted run. If the inputs or flags changed, it starts over. An
error (bad input) removes the temporary files instead. A lock file
(`.prepare.lock`, flock) stops two runs writing one directory.

Progress: one line on stderr per phase, redrawn in place on a terminal (or
every 10 s otherwise): documents, MB of text, MB/s, percentage and ETA.

`manifest.json` keys:

- `format` ("tfgpt-packed-tokens" or "tfgpt-encoder-segments"),
  `format_version` (1 for uncompressed packed data, otherwise 2), `feature`
  ("input_ids", or "token_ids" for encoder data), `seq_len`,
  `record_length` (`seq_len + 1` for packed data; the maximum tokens of a
  record, `seq_len - 3`, for encoder data), `compression` (null or "GZIP").
- `tokenizer`: `type` ("sentencepiece" or "wordpiece"), `model_type`,
  `byte_fallback`, `normalization`, `add_dummy_prefix`, `model_file`
  ("tokenizer.model" or "vocab.txt"), `sha256`, `vocabulary_size`,
  `pad_id`, `unk_id`, `bos_id`, `eos_id`, `eos_piece`, `cls_id`, `sep_id`,
  `mask_id` (-1 when absent), `trained`, `source`, `sample_documents`,
  `sample_bytes`.
- `splits.train`, `splits.val`: `documents`, `tokens`, `sequences`
  (records), `dropped_tail_tokens` (for packed data `tokens = sequences *
  record_length + dropped_tail_tokens`; encoder data also has `segments`),
  and `shards`: a list of `{filename, sequences, tokens, bytes, sha256,
  chunk}`.
- `totals`: `documents`, `input_bytes`, `skipped_empty_documents`, `tokens`,
  `sequences`, `dropped_tail_tokens`.
- `inputs`, `input_patterns`, `seed`, `val_fraction`, `shard_size`,
  `chunk_size`, `chunks`, `split_rule`.

Errors are reported as one line `error: ...` on stderr with exit status 2.
"""

import argparse
import concurrent.futures
import fcntl
import hashlib
import heapq
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from pipelines import sources as sources_module
from pipelines.errors import DataError
from pipelines.sources import ChunkReader, make_sources, plan_chunks, resolve_inputs  # noqa: F401
from pipelines.tfrecord import FRAMING_BYTES, TFRecordWriter, serialize_example, serialize_records
from pipelines.tokenizer import (
    MINIMUM_VOCABULARY_SIZE,
    Tokenizer,
    _write_atomically,
    minimum_vocabulary_size,
    train_tokenizer,
)

FORMAT_NAME = "tfgpt-packed-tokens"
ENCODER_FORMAT_NAME = "tfgpt-encoder-segments"
FORMATS = {"packed": FORMAT_NAME, "encoder": ENCODER_FORMAT_NAME}
FORMAT_VERSION = 1
FEATURE_NAME = "input_ids"
ENCODER_FEATURES = ("token_ids", "segment_lengths")
MANIFEST_FILENAME = "manifest.json"
TOKENIZER_FILENAME = "tokenizer.model"
STATE_FILENAME = ".prepare-state.json"
LOCK_FILENAME = ".prepare.lock"
STATE_VERSION = 1
SPLITS = ("train", "val")
TOKENIZER_TYPES = ("bpe", "unigram", "wordpiece")
COMPRESSIONS = {"none": None, "gzip": "GZIP"}

MINIMUM_SEQ_LEN = 8
DEFAULT_SHARD_SIZE = 1 << 30  # 1 GiB, as in the reference design.
MINIMUM_DEFAULT_CHUNK_SIZE = 64 << 20
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SEED = 0
# 64 MiB of text is plenty for vocabularies up to ~50k pieces, and SentencePiece
# needs roughly 10-20x the sample size in memory while training.
DEFAULT_TOKENIZER_SAMPLE_BYTES = 64 << 20

# The split decision uses the top 16 bits of each document's hash, so the
# validation share can be chosen to a resolution of 1/65536 of the key space.
SPLIT_HASH_BINS = 1 << 16
# Documents are encoded in batches of this many documents or bytes, whichever
# comes first, so SentencePiece has work and memory stays bounded.
ENCODE_BATCH_DOCUMENTS = 1024
ENCODE_BATCH_BYTES = 512 << 10
# Peak resident memory of any prepare process with a given SentencePiece
# tokenizer, whatever the corpus size (see the module docstring).
MEMORY_BOUND_MB = 60
PROGRESS_INTERVAL_SECONDS = 10.0
INTERACTIVE_PROGRESS_INTERVAL_SECONDS = 0.5

_SHARD_NAME_PATTERN = re.compile(r"^(train|val)-\d{5}-of-\d{5}\.tfrecord$")
_TEMPORARY_NAME_PATTERN = re.compile(r"^\.(train|val)-(c\d{5}-)?\d{5}\.tfrecord\.tmp$")
_TEMPORARY_TOKENIZER_NAMES = (".tokenizer.model.tmp", ".vocab.txt.tmp")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_MULTIPLIERS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# ----------------------------------------------------------------------------
# Argument parsing and validation.


def parse_size(text: str, argument_name: str = "size") -> int:
    """Parse a byte size such as `1048576`, `64K`, `10M`, `1G`, `1GiB` or `2gb`.

    Suffixes are binary (K = 1024 bytes). Used for `--shard-size`,
    `--chunk-size` and `--tokenizer-sample-bytes`.

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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_arguments(
    seq_len,
    vocabulary_size,
    shard_size,
    val_fraction,
    seed,
    tokenizer_sample_bytes,
    tokenizer_type="bpe",
) -> None:
    """Raise ValueError naming the first invalid argument."""
    if not _is_int(seq_len) or seq_len < MINIMUM_SEQ_LEN:
        raise ValueError(
            f"`seq_len` must be an int of at least {MINIMUM_SEQ_LEN}. "
            f"Received: seq_len={seq_len!r}"
        )
    if tokenizer_type == "wordpiece":
        from pipelines.wordpiece_tokenizer import MINIMUM_VOCABULARY_SIZE as wordpiece_minimum

        if vocabulary_size is not None and (
            not _is_int(vocabulary_size) or vocabulary_size < wordpiece_minimum
        ):
            raise ValueError(
                f"`vocabulary_size` must be an int of at least {wordpiece_minimum} for "
                f"WordPiece. Received: vocabulary_size={vocabulary_size!r}"
            )
    elif vocabulary_size is not None and (
        not _is_int(vocabulary_size) or vocabulary_size < MINIMUM_VOCABULARY_SIZE
    ):
        raise ValueError(
            f"`vocabulary_size` must be an int of at least {MINIMUM_VOCABULARY_SIZE} "
            "(3 special + 256 byte-fallback pieces + 1). "
            f"Received: vocabulary_size={vocabulary_size!r}"
        )
    if not _is_int(shard_size) or shard_size < 1:
        raise ValueError(
            f"`shard_size` must be a positive number of bytes. Received: shard_size={shard_size!r}"
        )
    if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"`val_fraction` must be in [0, 1). Received: val_fraction={val_fraction!r}"
        )
    if not _is_int(seed) or not 0 <= seed < (1 << 63):
        raise ValueError(f"`seed` must be an int in [0, 2**63). Received: seed={seed!r}")
    if not _is_int(tokenizer_sample_bytes) or tokenizer_sample_bytes < 1:
        raise ValueError(
            "`tokenizer_sample_bytes` must be a positive number of bytes. "
            f"Received: tokenizer_sample_bytes={tokenizer_sample_bytes!r}"
        )


# ----------------------------------------------------------------------------
# Hashing, sampling, progress.


def _document_digest(document_bytes: bytes, seed: int) -> bytes:
    """16-byte keyed hash; bytes 0-1 pick the split bin, bytes 8-15 the sample key."""
    return hashlib.blake2b(document_bytes, digest_size=16, key=seed.to_bytes(8, "little")).digest()


def _split_bin(digest: bytes) -> int:
    return int.from_bytes(digest[:2], "big")


class _ByteBudgetSampler:
    """The documents with the smallest random keys whose bytes fit a budget.

    Exactly the longest prefix, in key order, of all offered documents whose
    sizes sum to at most the budget, whatever the order of the offers: so
    per-chunk samplers merged in any order give the single-pass result. A
    document larger than the whole budget is truncated to it.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.total_bytes = 0
        self._heap = []  # Max-heap on the key via negation: (-key, text, bytes, bin).
        self._cutoff = None  # Smallest key ever evicted: no larger key may enter.

    def offer(self, key: int, text: str, size: int, split_bin: int) -> None:
        if self._cutoff is not None and key >= self._cutoff:
            return
        if size > self.budget_bytes:
            text = text.encode("utf-8")[: self.budget_bytes].decode("utf-8", "ignore")
            size = len(text.encode("utf-8"))
        heapq.heappush(self._heap, (-key, text, size, split_bin))
        self.total_bytes += size
        while self.total_bytes > self.budget_bytes:
            negative_key, _, removed_size, _ = heapq.heappop(self._heap)
            self.total_bytes -= removed_size
            self._cutoff = -negative_key

    def entries(self) -> list:
        """(key, text, bytes, bin) of the kept documents (for merging)."""
        return [
            (-negative_key, text, size, split_bin)
            for negative_key, text, size, split_bin in self._heap
        ]

    def documents(self, exclude_bins_below: int) -> List[str]:
        """The kept documents in key order, minus those in validation bins."""
        kept = sorted(self._heap, reverse=True)  # Ascending key.
        return [text for _, text, _, split_bin in kept if split_bin >= exclude_bins_below]


def _validation_bin_threshold(histogram, val_fraction: float) -> int:
    """Smallest number of leading bins holding at least `val_fraction` of the bytes."""
    if val_fraction <= 0.0:
        return 0
    cumulative = np.cumsum(np.asarray(histogram, dtype=np.int64))
    target = val_fraction * float(cumulative[-1])
    reached = np.nonzero((cumulative >= target) & (cumulative > 0))[0]
    return int(reached[0]) + 1 if reached.size else len(cumulative)


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _Progress:
    """A progress line for one phase: documents, MB, MB/s, percentage, ETA.

    On a terminal the line is redrawn in place on stderr; otherwise (files,
    tests) one line goes to `log` every `PROGRESS_INTERVAL_SECONDS`.
    """

    def __init__(
        self,
        phase: str,
        total_input_bytes: int,
        log: Callable[[str], None],
        interactive: bool = False,
    ):
        self.phase = phase
        self.total_input_bytes = max(total_input_bytes, 0)
        self.log = log
        self.interactive = interactive
        self.start = time.perf_counter()
        self._last_report = self.start
        self._drawn = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, documents: int, size: int, input_bytes: int) -> str:
        elapsed = max(self.elapsed(), 1e-9)
        text = (
            f"{self.phase}: {documents:,} documents, {size / 1e6:,.1f} MB, "
            f"{size / 1e6 / elapsed:,.1f} MB/s"
        )
        if self.total_input_bytes > 0:
            fraction = min(input_bytes / self.total_input_bytes, 1.0)
            eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
            text += f", {fraction:.0%}, ETA {_format_duration(eta) if eta == eta else '?'}"
        return text

    def update(self, documents: int, size: int, input_bytes: int) -> None:
        now = time.perf_counter()
        interval = (
            INTERACTIVE_PROGRESS_INTERVAL_SECONDS if self.interactive else PROGRESS_INTERVAL_SECONDS
        )
        if now - self._last_report < interval:
            return
        self._last_report = now
        if self.interactive:
            sys.stderr.write("\r[prepare] " + self.line(documents, size, input_bytes) + "\033[K")
            sys.stderr.flush()
            self._drawn = True
        else:
            self.log(self.line(documents, size, input_bytes))

    def done(self, documents: int, size: int, extra: str = "") -> None:
        if self._drawn:
            sys.stderr.write("\r\033[K")
        elapsed = max(self.elapsed(), 1e-9)
        self.log(
            f"{self.phase} done: {documents:,} documents, {size / 1e6:,.1f} MB, "
            f"{size / 1e6 / elapsed:,.1f} MB/s{extra} in {elapsed:.1f} s"
        )


class _Counters:
    """documents, text bytes, input bytes: shared with workers, or local."""

    def __init__(self, shared=None):
        self._shared = shared
        self._local = [0, 0, 0]
        self.on_update = None

    def add(self, documents: int, text_bytes: int, input_bytes: int) -> None:
        if self._shared is not None:
            with self._shared.get_lock():
                self._shared[0] += documents
                self._shared[1] += text_bytes
                self._shared[2] += input_bytes
        else:
            self._local[0] += documents
            self._local[1] += text_bytes
            self._local[2] += input_bytes
            if self.on_update is not None:
                self.on_update()

    def values(self):
        if self._shared is not None:
            with self._shared.get_lock():
                return tuple(self._shared[:])
        return tuple(self._local)


# ----------------------------------------------------------------------------
# Writing records.


def split_segments(text: str) -> List[str]:
    """Cut a document into segments: its lines, then sentences (a `.`, `!` or `?` then space)."""
    segments = []
    for line in text.split("\n"):
        for sentence in _SENTENCE_END.split(line.strip()):
            if sentence.strip():
                segments.append(sentence)
    return segments


class _SplitWriter:
    """Writes one chunk's records of one split and rolls shards by size.

    Packed format: documents (each followed by EOS) are packed into records
    of exactly `record_length` tokens; the partial record left at the end of
    the chunk is dropped. Encoder format: each document's segments are
    grouped into records of at most `record_length` tokens.

    Args:
        split: str. "train" or "val".
        directory: str. The output directory.
        chunk_index: int. Names the temporary shards.
        record_length: int. `seq_len + 1` (packed) or `seq_len - 3` (encoder).
        shard_size: int. A shard is closed before a record would take it past
            this many (uncompressed) bytes; a shard holds at least one record.
        compression: None or "GZIP".
        record_format: str. "packed" or "encoder".
    """

    def __init__(
        self,
        split,
        directory,
        chunk_index,
        record_length,
        shard_size,
        compression=None,
        record_format="packed",
    ):
        self.split = split
        self.directory = directory
        self.chunk_index = chunk_index
        self.record_length = record_length
        self.shard_size = shard_size
        self.compression = compression
        self.record_format = record_format
        self.shards = []  # dicts: temporary_name, sequences, tokens, bytes, sha256.
        self.documents = 0
        self.tokens = 0
        self.segments = 0
        self.dropped_tokens = 0
        self._carry = np.zeros((0,), dtype=np.int64)
        self._writer = None
        self._current = None
        self._current_tokens = 0

    def add_documents(self, token_lists: List[List[int]], eos_id: int) -> None:
        """Packed format: append documents (each followed by EOS); write full records."""
        if not token_lists:
            return
        lengths = [len(token_ids) + 1 for token_ids in token_lists]
        stream = np.full(sum(lengths), eos_id, dtype=np.int64)
        position = 0
        for token_ids, length in zip(token_lists, lengths):
            stream[position : position + length - 1] = token_ids
            position += length
        self.documents += len(token_lists)
        self.tokens += len(stream)
        stream = np.concatenate([self._carry, stream])
        number_of_records = len(stream) // self.record_length
        records = stream[: number_of_records * self.record_length].reshape(
            number_of_records, self.record_length
        )  # (records, seq_len + 1)
        self._carry = stream[number_of_records * self.record_length :].copy()
        for serialized in serialize_records(records):
            self._current_tokens = self.record_length
            self._write_record(serialized)

    def add_segmented_documents(self, documents: List[List[List[int]]]) -> None:
        """Encoder format: each document is a list of segments (token lists)."""
        limit = self.record_length
        for segments in documents:
            self.documents += 1
            group, group_tokens = [], 0
            for segment in segments:
                if not segment:
                    continue
                self.tokens += len(segment)
                for start in range(0, len(segment), limit):
                    piece = segment[start : start + limit]
                    if group and group_tokens + len(piece) > limit:
                        self._write_group(group, group_tokens)
                        group, group_tokens = [], 0
                    group.append(piece)
                    group_tokens += len(piece)
            if group:
                self._write_group(group, group_tokens)

    def _write_group(self, group, group_tokens) -> None:
        if group_tokens < 2:  # No A/B pair can be made.
            self.dropped_tokens += group_tokens
            return
        self.segments += len(group)
        serialized = serialize_example(
            {
                ENCODER_FEATURES[0]: [token for piece in group for token in piece],
                ENCODER_FEATURES[1]: [len(piece) for piece in group],
            }
        )
        self._current_tokens = group_tokens
        self._write_record(serialized)

    def _write_record(self, serialized: bytes) -> None:
        size = len(serialized) + FRAMING_BYTES
        if (
            self._current is not None
            and self._current["uncompressed_bytes"] + size > self.shard_size
        ):
            self._close_shard()
        if self._current is None:
            self._open_shard()
        self._writer.write(serialized)
        self._current["uncompressed_bytes"] += size
        self._current["sequences"] += 1
        self._current["tokens"] += self._current_tokens

    def _open_shard(self) -> None:
        name = f".{self.split}-c{self.chunk_index:05d}-{len(self.shards):05d}.tfrecord.tmp"
        self._current = {
            "temporary_name": name,
            "sequences": 0,
            "tokens": 0,
            "uncompressed_bytes": 0,
        }
        self.shards.append(self._current)
        self._writer = TFRecordWriter(os.path.join(self.directory, name), self.compression)

    def _close_shard(self) -> None:
        closed = self._writer.close()
        self._writer = None
        self._current["bytes"] = closed["bytes"]
        self._current["sha256"] = closed["sha256"]
        del self._current["uncompressed_bytes"]
        self._current = None

    def close(self) -> None:
        """Close the last shard. A packed partial record left over is dropped."""
        if self._current is not None:
            self._close_shard()

    def abort(self) -> None:
        """Close the open writer without finishing (used on errors)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    @property
    def sequences(self) -> int:
        return sum(shard["sequences"] for shard in self.shards)

    @property
    def dropped_tail_tokens(self) -> int:
        return len(self._carry) + self.dropped_tokens

    def summary(self) -> dict:
        summary = {
            "documents": self.documents,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "dropped_tail_tokens": self.dropped_tail_tokens,
            "shards": [dict(shard) for shard in self.shards],
        }
        if self.record_format == "encoder":
            summary["segments"] = self.segments
        return summary


# ----------------------------------------------------------------------------
# Per-chunk work (run in worker processes, or in this one with one worker).

_WORKER = {"job": None, "counters": None, "tokenizer": None}


def _exit_when_orphaned(parent_pid: int) -> None:
    """End this worker if the main process dies (e.g. `kill -9`): nobody will collect its work."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _initialize_worker(job: dict, shared_counters) -> None:
    # Ctrl-C goes to the whole process group: the parent handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    _WORKER["job"] = job
    _WORKER["counters"] = _Counters(shared_counters)
    _WORKER["tokenizer"] = None


def _load_temporary_tokenizer(path: str):
    """Load `.tokenizer.model.tmp` or `.vocab.txt.tmp` by its name."""
    if os.path.basename(path) == ".vocab.txt.tmp":
        from pipelines.wordpiece_tokenizer import WordPieceTokenizer

        return WordPieceTokenizer.load(path)
    return Tokenizer.load(path)


def _worker_tokenizer(job):
    if _WORKER["tokenizer"] is None:
        _WORKER["tokenizer"] = _load_temporary_tokenizer(job["tokenizer_path"])
    return _WORKER["tokenizer"]


def _run_task(task):
    phase, chunk_index, segments = task
    function = _scan_chunk if phase == "scan" else _encode_chunk
    return function(_WORKER["job"], chunk_index, segments, _WORKER["counters"])


def _chunk_reader(job, segments, counters):
    sources = [sources_module.Source(*source) for source in job["sources"]]
    return ChunkReader(
        sources,
        segments,
        text_key=job["text_key"],
        tfds_data_dir=job["tfds_data_dir"],
        on_progress=lambda consumed: counters.add(0, 0, consumed),
    )


def _scan_chunk(job, chunk_index, segments, counters) -> dict:
    """Pass 1 over one chunk: counts, split histogram, tokenizer sample candidates."""
    histogram = np.zeros(SPLIT_HASH_BINS, dtype=np.int64)
    sampler = _ByteBudgetSampler(job["sample_bytes"]) if job["collect_sample"] else None
    reader = _chunk_reader(job, segments, counters)
    documents = total_bytes = pending_documents = pending_bytes = 0
    for _, text in reader:
        data = text.encode("utf-8")
        digest = _document_digest(data, job["seed"])
        split_bin = _split_bin(digest)
        histogram[split_bin] += len(data)
        if sampler is not None:
            sampler.offer(int.from_bytes(digest[8:], "big"), text, len(data), split_bin)
        documents += 1
        total_bytes += len(data)
        pending_documents += 1
        pending_bytes += len(data)
        if pending_documents >= 1000:
            counters.add(pending_documents, pending_bytes, 0)
            pending_documents = pending_bytes = 0
    counters.add(pending_documents, pending_bytes, 0)
    return {
        "chunk": chunk_index,
        "documents": documents,
        "bytes": total_bytes,
        "empty_documents": reader.empty_documents,
        "documents_per_source": reader.documents_per_source,
        "histogram": histogram,
        "sample": sampler.entries() if sampler is not None else [],
    }


def _encode_chunk(job, chunk_index, segments, counters) -> dict:
    """Pass 2 over one chunk: encode, pack and write this chunk's shards."""
    tokenizer = _worker_tokenizer(job)
    writers = {
        split: _SplitWriter(
            split,
            job["output_directory"],
            chunk_index,
            job["record_length"],
            job["shard_size"],
            job["compression"],
            job["format"],
        )
        for split in job["splits"]
    }
    encoder = job["format"] == "encoder"
    threshold = job["validation_bin_threshold"]
    reader = _chunk_reader(job, segments, counters)
    batch_texts, batch_splits = [], []
    state = {"documents": 0, "bytes": 0, "batch_bytes": 0}

    def flush():
        if encoder:
            segment_lists = [split_segments(text) for text in batch_texts]
            flat = [segment for segments_of_one in segment_lists for segment in segments_of_one]
            encoded = tokenizer.encode_batch(flat, num_threads=job["num_threads"])
            token_lists, position = [], 0
            for segments_of_one in segment_lists:
                token_lists.append(encoded[position : position + len(segments_of_one)])
                position += len(segments_of_one)
        else:
            token_lists = tokenizer.encode_batch(batch_texts, num_threads=job["num_threads"])
        for split, writer in writers.items():
            selected = [
                token_ids
                for token_ids, document_split in zip(token_lists, batch_splits)
                if document_split == split
            ]
            if encoder:
                writer.add_segmented_documents(selected)
            else:
                writer.add_documents(selected, tokenizer.eos_id)
        counters.add(len(batch_texts), state["batch_bytes"], 0)
        batch_texts.clear()
        batch_splits.clear()
        state["batch_bytes"] = 0

    try:
        for _, text in reader:
            data = text.encode("utf-8")
            split = (
                "val" if _split_bin(_document_digest(data, job["seed"])) < threshold else "train"
            )
            batch_texts.append(text)
            batch_splits.append(split)
            state["batch_bytes"] += len(data)
            state["documents"] += 1
            state["bytes"] += len(data)
            if (
                len(batch_texts) >= ENCODE_BATCH_DOCUMENTS
                or state["batch_bytes"] >= ENCODE_BATCH_BYTES
            ):
                flush()
        if batch_texts:
            flush()
        for writer in writers.values():
            writer.close()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return {
        "chunk": chunk_index,
        "documents": state["documents"],
        "bytes": state["bytes"],
        "empty_documents": reader.empty_documents,
        "splits": {split: writer.summary() for split, writer in writers.items()},
    }


def _on_chunk_encoded(chunk_index: int) -> None:
    """Called after each chunk's shards are recorded in the state file (a test hook)."""


class WorkerDied(RuntimeError):
    """A worker process ended abnormally (killed, out of memory): an interruption."""


class _ChunkRunner:
    """Runs per-chunk tasks in a process pool, or in this process for one worker.

    The pool is a `concurrent.futures.ProcessPoolExecutor`: a worker that
    dies (`kill -9`, the out-of-memory killer) fails the run at once with
    `WorkerDied` instead of leaving its task waiting forever, as a
    `multiprocessing.Pool` would.
    """

    def __init__(self, job: dict, workers: int):
        self.job = job
        self.workers = workers
        self.counters = _Counters()
        self.pool = None
        if workers > 1:
            # fork is fast and inherits everything, but forking a process that
            # has started TensorFlow's threads can deadlock the child.
            method = "spawn" if "tensorflow" in sys.modules else "fork"
            context = multiprocessing.get_context(method)
            shared = context.Array("q", 3)
            self.counters = _Counters(shared)
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=context, initializer=_initialize_worker, initargs=(job, shared)
            )
        else:
            _WORKER["job"] = job
            _WORKER["counters"] = self.counters
            _WORKER["tokenizer"] = None

    def run(self, phase: str, chunks, progress: _Progress):
        """Yield the results of `phase` over `chunks` ([(index, segments)]) as they finish."""
        tasks = [(phase, index, segments) for index, segments in chunks]
        if self.pool is None:
            self.counters.on_update = lambda: progress.update(*self.counters.values())
            for task in tasks:
                yield _run_task(task)
            self.counters.on_update = None
            return
        pending = {self.pool.submit(_run_task, task) for task in tasks}
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=0.25, return_when=concurrent.futures.FIRST_COMPLETED
            )
            progress.update(*self.counters.values())
            for future in done:
                try:
                    result = future.result()
                except concurrent.futures.process.BrokenProcessPool as error:
                    raise WorkerDied(
                        f"a {phase} worker process died ({error}); finished chunks are kept: "
                        "rerun the same command to resume"
                    ) from None
                yield result

    def __enter__(self) -> "_ChunkRunner":
        return self

    def __exit__(self, exception_type, exception, traceback) -> None:
        self.close(terminate=exception_type is not None)

    def close(self, terminate: bool = False) -> None:
        if self.pool is not None:
            if terminate:
                # The executor has no terminate(): stop its processes directly.
                for process in list((self.pool._processes or {}).values()):
                    process.terminate()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        _WORKER.update(job=None, counters=None, tokenizer=None)


# ----------------------------------------------------------------------------
# Output directory: lock, state, temporaries, commit.


def _existing_dataset_files(directory: str) -> List[str]:
    return sorted(
        name
        for name in os.listdir(directory)
        if _SHARD_NAME_PATTERN.match(name) or name == MANIFEST_FILENAME
    )


def _remove_temporary_files(directory: str) -> None:
    """Delete temporary files and the resume state (this run's or a crashed run's)."""
    for name in os.listdir(directory):
        if (
            _TEMPORARY_NAME_PATTERN.match(name)
            or name in _TEMPORARY_TOKENIZER_NAMES
            or name == STATE_FILENAME
        ):
            os.remove(os.path.join(directory, name))


def _chunk_temporary_names(directory: str, chunk_index: int) -> List[str]:
    marker = f"-c{chunk_index:05d}-"
    return [
        name
        for name in os.listdir(directory)
        if _TEMPORARY_NAME_PATTERN.match(name) and marker in name
    ]


class _DirectoryLock:
    """An exclusive flock on `.prepare.lock`; the file is removed on release."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILENAME)
        self.file_descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.file_descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.file_descriptor)
            raise DataError(
                f"{directory}: another pipelines.prepare is writing to this directory "
                f"(it holds {LOCK_FILENAME}); wait for it to finish"
            ) from None
        os.ftruncate(self.file_descriptor, 0)
        os.write(self.file_descriptor, f"{os.getpid()}\n".encode("ascii"))

    def release(self) -> None:
        if self.file_descriptor is not None:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            os.close(self.file_descriptor)
            self.file_descriptor = None


def _fsync_directory(directory: str) -> None:
    """Make renames in `directory` durable."""
    file_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(file_descriptor)
    finally:
        os.close(file_descriptor)


def _sha256_of_file(path: str) -> Optional[str]:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as input_file:
            while True:
                block = input_file.read(8 << 20)
                if not block:
                    break
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _write_state(directory: str, state: dict) -> None:
    _write_atomically(
        os.path.join(directory, STATE_FILENAME), (json.dumps(state) + "\n").encode("utf-8")
    )


def _read_state(directory: str) -> Optional[dict]:
    path = os.path.join(directory, STATE_FILENAME)
    try:
        with open(path, encoding="utf-8") as state_file:
            state = json.load(state_file)
    except (OSError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else None


def _final_shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def _ordered_shards(chunk_results: dict, split: str) -> List[dict]:
    """The split's shards in chunk order, then write order within a chunk."""
    shards = []
    for chunk_index in sorted(chunk_results):
        summary = chunk_results[chunk_index]["splits"].get(split)
        if summary:
            for shard in summary["shards"]:
                shards.append(dict(shard, chunk=chunk_index))
    return shards


def _commit(
    directory: str,
    tokenizer_temporary: str,
    tokenizer_filename: str,
    chunk_results: dict,
    manifest: dict,
) -> None:
    """Move temporaries to final names, then write the manifest last."""
    # Remove the old manifest first: from here until the new one is written the
    # directory is, correctly, not a dataset.
    manifest_path = os.path.join(directory, MANIFEST_FILENAME)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)
    for name in _existing_dataset_files(directory):
        os.remove(os.path.join(directory, name))
    for name in ("tokenizer.model", "vocab.txt"):
        if name != tokenizer_filename and os.path.exists(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))
    _fsync_directory(directory)
    os.replace(tokenizer_temporary, os.path.join(directory, tokenizer_filename))
    for split in SPLITS:
        shards = _ordered_shards(chunk_results, split)
        for index, shard in enumerate(shards):
            os.replace(
                os.path.join(directory, shard["temporary_name"]),
                os.path.join(directory, _final_shard_name(split, index, len(shards))),
            )
    _fsync_directory(directory)
    _write_atomically(manifest_path, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    os.remove(os.path.join(directory, STATE_FILENAME))
    _fsync_directory(directory)


# ----------------------------------------------------------------------------
# Manifest.


def _split_summary(chunk_results: dict, split: str, record_format: str) -> dict:
    shards = _ordered_shards(chunk_results, split)
    summaries = [
        result["splits"][split] for result in chunk_results.values() if split in result["splits"]
    ]
    summary = {
        key: sum(item[key] for item in summaries)
        for key in ("documents", "tokens", "sequences", "dropped_tail_tokens")
    }
    if record_format == "encoder":
        summary["segments"] = sum(item.get("segments", 0) for item in summaries)
    summary["shards"] = [
        {
            "filename": _final_shard_name(split, index, len(shards)),
            "sequences": shard["sequences"],
            "tokens": shard["tokens"],
            "bytes": shard["bytes"],
            "sha256": shard["sha256"],
            "chunk": shard["chunk"],
        }
        for index, shard in enumerate(shards)
    ]
    return summary


def _tokenizer_description(tokenizer, tokenizer_path, sample_documents, sample_bytes) -> dict:
    return {
        "type": "wordpiece" if tokenizer.filename == "vocab.txt" else "sentencepiece",
        **tokenizer.settings(),
        "model_file": tokenizer.filename,
        "sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(),
        "vocabulary_size": tokenizer.vocabulary_size,
        "pad_id": tokenizer.pad_id,
        "unk_id": tokenizer.unk_id,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "eos_piece": tokenizer.id_to_piece(tokenizer.eos_id),
        "cls_id": tokenizer.cls_id,
        "sep_id": tokenizer.sep_id,
        "mask_id": tokenizer.mask_id,
        "trained": tokenizer_path is None,
        "source": None if tokenizer_path is None else os.path.abspath(tokenizer_path),
        "sample_documents": None if tokenizer_path else sample_documents,
        "sample_bytes": None if tokenizer_path else sample_bytes,
    }


def _stderr_log(message: str) -> None:
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def _load_reused_tokenizer(tokenizer_path, vocabulary_size, record_format):
    tokenizer = Tokenizer.load(tokenizer_path)
    if tokenizer.eos_id < 0:
        raise ValueError(f"{tokenizer_path}: the tokenizer has no EOS piece (eos_id=-1)")
    if vocabulary_size is not None and vocabulary_size != tokenizer.vocabulary_size:
        raise ValueError(
            f"`vocabulary_size` must match the tokenizer at {tokenizer_path}. "
            f"Received: vocabulary_size={vocabulary_size}, tokenizer has "
            f"{tokenizer.vocabulary_size}"
        )
    if (
        record_format == "encoder"
        and min(tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id) < 0
    ):
        raise ValueError(
            f"{tokenizer_path}: --format encoder needs a tokenizer with [CLS], [SEP] and "
            "[MASK] pieces; train one with --format encoder or use --tokenizer-type wordpiece"
        )
    return tokenizer


def prepare(
    output_directory: str,
    inputs: Optional[Sequence[str]] = None,
    *,
    seq_len: int,
    vocabulary_size: Optional[int] = None,
    tokenizer_path: Optional[str] = None,
    tokenizer_type: str = "bpe",
    shard_size: int = DEFAULT_SHARD_SIZE,
    chunk_size: Optional[int] = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = DEFAULT_SEED,
    tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES,
    overwrite: bool = False,
    num_threads: Optional[int] = None,
    workers: Optional[int] = None,
    record_format: str = "packed",
    compression: Optional[str] = None,
    tfds: Sequence[str] = (),
    tfds_data_dir: Optional[str] = None,
    text_key: str = "text",
    log: Callable[[str], None] = _stderr_log,
    interactive_progress: bool = False,
) -> dict:
    """Build a tfgpt data directory from raw text. The CLI calls this.

    Args:
        output_directory: str. Created if missing. Must not already hold
            shards or a manifest unless `overwrite=True`.
        inputs: sequence of str or None. Files, globs or directories (see
            `pipelines.sources`); None (and no `tfds`) uses
            `pipelines.default_corpus`.
        seq_len: int. Model context length, at least `MINIMUM_SEQ_LEN` (8).
            Packed records hold `seq_len + 1` tokens; encoder examples are
            `seq_len` tokens including [CLS] and two [SEP].
        vocabulary_size: int or None. Size of the tokenizer to train (an
            upper bound for WordPiece). Required unless `tokenizer_path` is
            given (then it must match, if given).
        tokenizer_path: str or None. An existing tokenizer to reuse: a
            SentencePiece model, a WordPiece `vocab.txt`, or a directory with
            either (e.g. an earlier data directory).
        tokenizer_type: str. "bpe", "unigram" (SentencePiece) or "wordpiece".
        shard_size: int. Target shard size in bytes (default 1 GiB).
        chunk_size: int or None. Bytes of input per unit of work (default
            `max(2 * shard_size, 64 MiB)`).
        val_fraction: float. Share of the corpus's bytes, in [0, 1), that goes
            to the validation split, by whole documents. 0 writes no val split.
        seed: int. Keys the document hash that decides splits and the
            tokenizer sample.
        tokenizer_sample_bytes: int. Cap on the training documents' bytes
            used to train the tokenizer (default 64 MiB).
        overwrite: bool. Replace an existing dataset in `output_directory`.
        num_threads: int or None. SentencePiece threads per worker; None uses
            the cores not taken by other workers.
        workers: int or None. Processes; None uses every core.
        record_format: str. "packed" (GPT) or "encoder" (BERT/ALBERT).
        compression: None or "GZIP".
        tfds: sequence of str. TensorFlow Datasets splits, `NAME[:SPLIT]`.
        tfds_data_dir: str or None. Their (already prepared) data directory.
        text_key: str. JSON / TFDS feature holding the text.
        log: callable taking a str. Progress sink (stderr by default).
        interactive_progress: bool. Redraw the progress line in place.

    Returns:
        dict. The manifest, as written to `manifest.json`.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"`tokenizer_type` must be one of {TOKENIZER_TYPES}. "
            f"Received: tokenizer_type={tokenizer_type!r}"
        )
    _validate_arguments(
        seq_len,
        vocabulary_size,
        shard_size,
        val_fraction,
        seed,
        tokenizer_sample_bytes,
        tokenizer_type,
    )
    if record_format not in FORMATS:
        raise ValueError(
            f"`record_format` must be one of {tuple(FORMATS)}. "
            f"Received: record_format={record_format!r}"
        )
    if compression not in (None, "GZIP"):
        raise ValueError(
            f"`compression` must be None or 'GZIP'. Received: compression={compression!r}"
        )
    encoder = record_format == "encoder"
    if tokenizer_type != "wordpiece" and vocabulary_size is not None:
        minimum = minimum_vocabulary_size(encoder)
        if vocabulary_size < minimum:
            raise ValueError(
                f"`vocabulary_size` must be an int of at least {minimum} for --format "
                f"{record_format}. Received: vocabulary_size={vocabulary_size}"
            )
    if chunk_size is None:
        chunk_size = max(2 * shard_size, MINIMUM_DEFAULT_CHUNK_SIZE)
    if not _is_int(chunk_size) or chunk_size < 1:
        raise ValueError(
            f"`chunk_size` must be a positive number of bytes. Received: chunk_size={chunk_size!r}"
        )
    if workers is None:
        workers = os.cpu_count() or 1
    if not _is_int(workers) or workers < 1:
        raise ValueError(f"`workers` must be a positive int. Received: workers={workers!r}")
    if encoder and seq_len - 3 < 2:
        raise ValueError(
            "`seq_len` must leave room for 2 tokens after [CLS] and two [SEP]. "
            f"Received: seq_len={seq_len}"
        )
    if vocabulary_size is None and tokenizer_path is None:
        raise ValueError(
            "`vocabulary_size` is required to train a tokenizer (or pass `tokenizer_path`). "
            "Received: vocabulary_size=None, tokenizer_path=None"
        )
    if inputs is not None and len(inputs) == 0:
        raise ValueError("`inputs` must be None (default corpus) or non-empty. Received: []")
    files = [] if inputs is None else resolve_inputs(inputs)
    tfds = list(tfds)
    if inputs is None and not tfds:
        from pipelines import default_corpus

        sources = [sources_module.Source(default_corpus.describe(), "default", 0)]
        log(f"no --input: using {default_corpus.describe()}")
    else:
        sources = make_sources(files, tfds)
        names = [source.path for source in sources]
        log(f"{len(sources)} input(s): {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    tokenizer = None
    if tokenizer_path is not None:
        tokenizer = _load_reused_tokenizer(tokenizer_path, vocabulary_size, record_format)
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // workers)

    if os.path.exists(output_directory) and not os.path.isdir(output_directory):
        raise DataError(f"{output_directory}: output path exists and is not a directory")
    os.makedirs(output_directory, exist_ok=True)
    lock = _DirectoryLock(output_directory)
    try:
        existing = _existing_dataset_files(output_directory)
        if existing and not overwrite:
            raise DataError(
                f"{output_directory}: output directory already contains a dataset "
                f"({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}); "
                "pass --overwrite to replace it"
            )
        chunks = plan_chunks(sources, chunk_size)
        record_length = seq_len - 3 if encoder else seq_len + 1
        splits = ["train"] + (["val"] if val_fraction > 0 else [])
        # Everything that decides the output: a rerun resumes only if it matches.
        settings = {
            "inputs": sources_module.fingerprint(sources),
            "seq_len": seq_len,
            "vocabulary_size": vocabulary_size,
            "tokenizer": (
                None if tokenizer is None else hashlib.sha256(tokenizer.model_proto).hexdigest()
            ),
            "tokenizer_type": tokenizer_type,
            "shard_size": shard_size,
            "chunk_size": chunk_size,
            "val_fraction": val_fraction,
            "seed": seed,
            "tokenizer_sample_bytes": tokenizer_sample_bytes,
            "format": record_format,
            "compression": compression,
            "text_key": text_key,
        }
        job = {
            "sources": [(source.path, source.kind, source.size) for source in sources],
            "output_directory": output_directory,
            "seed": seed,
            "text_key": text_key,
            "tfds_data_dir": tfds_data_dir,
            "sample_bytes": tokenizer_sample_bytes,
            "collect_sample": tokenizer is None,
            "record_length": record_length,
            "shard_size": shard_size,
            "compression": compression,
            "format": record_format,
            "splits": splits,
            "num_threads": num_threads,
        }
        timings = {}
        total_input_bytes = sum(source.size for source in sources)

        # Scan and tokenizer, or both from an interrupted run's state.
        state = _resumable_state(output_directory, settings, log)
        if state is None:
            with _ChunkRunner(job, min(workers, len(chunks))) as runner:
                scan = _scan(runner, chunks, sources, val_fraction, total_input_bytes, log)
            timings["scan_seconds"] = scan.pop("seconds")
            start = time.perf_counter()
            sample = scan.pop("sample")
            sample_bytes = sum(len(text.encode("utf-8")) for text in sample)
            if tokenizer is None:
                log(
                    f"tokenizer: training {tokenizer_type}, vocabulary_size={vocabulary_size}, "
                    f"on {len(sample):,} documents ({sample_bytes / 1e6:,.1f} MB)"
                )
                tokenizer = _train_tokenizer(
                    sample, tokenizer_type, vocabulary_size, max(workers, num_threads), encoder
                )
            tokenizer_temporary = os.path.join(output_directory, f".{tokenizer.filename}.tmp")
            _write_atomically(tokenizer_temporary, tokenizer.model_proto)
            timings["tokenizer_seconds"] = time.perf_counter() - start
            log(f"tokenizer done in {timings['tokenizer_seconds']:.1f} s")
            state = {
                "version": STATE_VERSION,
                "settings": settings,
                "scan": dict(scan, sample_documents=len(sample), sample_bytes=sample_bytes),
                "tokenizer_file": os.path.basename(tokenizer_temporary),
                "tokenizer_sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(),
                "chunks": {},
            }
            del sample
            _write_state(output_directory, state)
        else:
            tokenizer_temporary = os.path.join(output_directory, state["tokenizer_file"])
            tokenizer = _load_temporary_tokenizer(tokenizer_temporary)
        scan = state["scan"]
        job["tokenizer_path"] = tokenizer_temporary
        job["validation_bin_threshold"] = scan["validation_bin_threshold"]
        if encoder and min(tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id) < 0:
            raise ValueError(
                "--format encoder needs a tokenizer with [CLS], [SEP] and [MASK] pieces"
            )

        # Encode and write.
        progress = _Progress("encode+write", total_input_bytes, log, interactive_progress)
        chunk_results = _encode(job, chunks, sources, state, workers, progress, log)
        timings["encode_and_write_seconds"] = progress.elapsed()
        _check_results(
            chunk_results, scan, chunks, sources, splits, record_format, seq_len, val_fraction
        )
        manifest = _build_manifest(
            chunk_results=chunk_results,
            tokenizer=tokenizer,
            tokenizer_path=tokenizer_path,
            scan=scan,
            sources=sources,
            inputs=inputs,
            tfds=tfds,
            seq_len=seq_len,
            record_length=record_length,
            record_format=record_format,
            compression=compression,
            seed=seed,
            val_fraction=val_fraction,
            shard_size=shard_size,
            chunk_size=chunk_size,
            number_of_chunks=len(chunks),
        )
        start = time.perf_counter()
        _commit(output_directory, tokenizer_temporary, tokenizer.filename, chunk_results, manifest)
        timings["commit_seconds"] = time.perf_counter() - start
    except (KeyboardInterrupt, SystemExit, WorkerDied):
        # An interruption: keep finished chunks and the state for the rerun.
        log(
            "interrupted: rerun the same command to resume; finished chunks are kept in "
            f"{output_directory}"
        )
        raise
    except BaseException:
        _remove_temporary_files(output_directory)
        raise
    finally:
        lock.release()

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


def _train_tokenizer(sample, tokenizer_type, vocabulary_size, num_threads, encoder):
    if tokenizer_type == "wordpiece":
        from pipelines.wordpiece_tokenizer import train_wordpiece

        return train_wordpiece(sample, vocabulary_size)
    return train_tokenizer(
        sample,
        vocabulary_size,
        None,
        num_threads=num_threads,
        model_type=tokenizer_type,
        encoder_special_tokens=encoder,
    )


def _resumable_state(directory: str, settings: dict, log) -> Optional[dict]:
    """An interrupted run's state if it can be resumed; otherwise clear its files, None."""
    state = _read_state(directory)
    if state is not None and state.get("settings") != settings:
        log("found an interrupted run with other inputs or flags: starting over")
        state = None
    if state is not None and (
        _sha256_of_file(os.path.join(directory, state["tokenizer_file"]))
        != state["tokenizer_sha256"]
    ):
        log("the interrupted run's tokenizer is missing or altered: starting over")
        state = None
    if state is None:
        _remove_temporary_files(directory)
    return state


def _encode(job, chunks, sources, state, workers, progress, log) -> dict:
    """Pass 2: encode every chunk an interrupted run has not finished; all chunks' results."""
    directory = job["output_directory"]
    chunk_results = _verified_chunks(directory, state, log)
    state["chunks"] = {str(index): result for index, result in chunk_results.items()}
    _write_state(directory, state)
    for name in os.listdir(directory):
        match = _TEMPORARY_NAME_PATTERN.match(name)
        if match and not (match.group(2) and int(match.group(2)[1:-1]) in chunk_results):
            os.remove(os.path.join(directory, name))  # A chunk that did not finish.
    pending = [
        (index, segments) for index, segments in enumerate(chunks) if index not in chunk_results
    ]
    if chunk_results:
        log(
            f"resuming: {len(chunk_results)} of {len(chunks)} chunk(s) already written "
            "(checksums verified); encoding the rest"
        )
    with _ChunkRunner(job, min(workers, max(len(pending), 1))) as runner:
        runner.counters.add(
            0,
            0,
            sum(
                sources_module.chunk_input_bytes(sources, chunks[index]) for index in chunk_results
            ),
        )
        for result in runner.run("encode", pending, progress):
            index = result["chunk"]
            chunk_results[index] = result
            state["chunks"][str(index)] = result
            _write_state(directory, state)  # This chunk is now safe from a crash.
            _on_chunk_encoded(index)
    tokens = sum(
        summary["tokens"]
        for result in chunk_results.values()
        for summary in result["splits"].values()
    )
    progress.done(
        sum(result["documents"] for result in chunk_results.values()),
        sum(result["bytes"] for result in chunk_results.values()),
        f", {tokens:,} tokens",
    )
    return chunk_results


def _check_results(
    chunk_results, scan, chunks, sources, splits, record_format, seq_len, val_fraction
):
    """Raise DataError if the input changed since the scan, or a split got no record."""
    for index, result in chunk_results.items():
        expected = scan["chunks"][str(index)]
        if (result["documents"], result["bytes"]) != tuple(expected):
            raise DataError(
                f"the input changed while being prepared: chunk {index} "
                f"({sources_module.describe_chunk(sources, chunks[index])}) had "
                f"{expected[0]} documents / {expected[1]} bytes in the scan and "
                f"{result['documents']} / {result['bytes']} when encoded"
            )
    for split in splits:
        summary = _split_summary(chunk_results, split, record_format)
        if summary["sequences"] == 0:
            raise DataError(
                f"corpus too small for --seq-len {seq_len} and --val-fraction "
                f"{val_fraction}: the {split} split got {summary['tokens']:,} tokens from "
                f"{summary['documents']:,} document(s), but one record needs "
                f"{seq_len + 1 if record_format == 'packed' else 2}; add text, lower --seq-len"
                + (" or raise --val-fraction" if split == "val" else "")
            )


def _scan(runner, chunks, sources, val_fraction, total_input_bytes, log) -> dict:
    """Pass 1 over every chunk: counts, the validation threshold and the sample."""
    progress = _Progress("scan", total_input_bytes, log)
    histogram = np.zeros(SPLIT_HASH_BINS, dtype=np.int64)
    sampler = _ByteBudgetSampler(runner.job["sample_bytes"])
    per_chunk = {}
    per_source = {}
    empty_documents = 0
    for result in runner.run("scan", list(enumerate(chunks)), progress):
        histogram += result["histogram"]
        for entry in result["sample"]:
            sampler.offer(*entry)
        per_chunk[str(result["chunk"])] = [result["documents"], result["bytes"]]
        for source_index, count in result["documents_per_source"].items():
            per_source[source_index] = per_source.get(source_index, 0) + count
        empty_documents += result["empty_documents"]
    for source_index, source in enumerate(sources):
        if per_source.get(source_index, 0) == 0:
            raise DataError(f"{source.path}: empty input (no non-whitespace text)")
    documents = sum(count for count, _ in per_chunk.values())
    total_bytes = sum(size for _, size in per_chunk.values())
    threshold = _validation_bin_threshold(histogram, val_fraction)
    validation_bytes = int(histogram[:threshold].sum())
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
        "empty_documents": empty_documents,
        "validation_bin_threshold": threshold,
        "chunks": per_chunk,
        "sample": sampler.documents(exclude_bins_below=threshold),
        "seconds": progress.elapsed(),
    }


def _verified_chunks(directory: str, state: dict, log) -> dict:
    """Finished chunks of an interrupted run whose shards all match their SHA-256."""
    verified = {}
    for key, result in state.get("chunks", {}).items():
        intact = all(
            _sha256_of_file(os.path.join(directory, shard["temporary_name"])) == shard["sha256"]
            for summary in result["splits"].values()
            for shard in summary["shards"]
        )
        if intact:
            verified[int(key)] = result
        else:
            log(f"chunk {key}: a shard is missing or altered; encoding the chunk again")
            for name in _chunk_temporary_names(directory, int(key)):
                os.remove(os.path.join(directory, name))
    return verified


def _build_manifest(
    *,
    chunk_results,
    tokenizer,
    tokenizer_path,
    scan,
    sources,
    inputs,
    tfds,
    seq_len,
    record_length,
    record_format,
    compression,
    seed,
    val_fraction,
    shard_size,
    chunk_size,
    number_of_chunks,
) -> dict:
    """The manifest's contents; see the module docstring for the keys."""
    splits = {split: _split_summary(chunk_results, split, record_format) for split in SPLITS}
    version = FORMAT_VERSION if record_format == "packed" and compression is None else 2
    return {
        "format": FORMATS[record_format],
        "format_version": version,
        "feature": FEATURE_NAME if record_format == "packed" else ENCODER_FEATURES[0],
        "seq_len": seq_len,
        "record_length": record_length,
        "compression": compression,
        "tokenizer": _tokenizer_description(
            tokenizer, tokenizer_path, scan["sample_documents"], scan["sample_bytes"]
        ),
        "splits": splits,
        "totals": {
            "documents": scan["documents"],
            "input_bytes": scan["bytes"],
            "skipped_empty_documents": scan["empty_documents"],
            "tokens": sum(split["tokens"] for split in splits.values()),
            "sequences": sum(split["sequences"] for split in splits.values()),
            "dropped_tail_tokens": sum(split["dropped_tail_tokens"] for split in splits.values()),
        },
        "inputs": [
            source.path if source.kind in ("default", "tfds") else os.path.abspath(source.path)
            for source in sources
        ],
        "input_patterns": None if inputs is None else list(inputs),
        "tfds": list(tfds) or None,
        "seed": seed,
        "val_fraction": val_fraction,
        "shard_size": shard_size,
        "chunk_size": chunk_size,
        "chunks": number_of_chunks,
        "split_rule": (
            "document to val iff the top 16 bits of blake2b(text, key=seed as 8 "
            f"little-endian bytes, digest_size=16) < {scan['validation_bin_threshold']}"
        ),
    }


def _build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.prepare",
        description=(
            "Train a tokenizer and write sharded TFRecords (train/val) plus manifest.json, "
            "in parallel and resumably. Plain-text inputs: one document per block "
            "of non-blank lines (blank lines separate documents). JSON Lines inputs "
            "(.jsonl/.json, or .jsonl.zst streamed): one document per line, its string "
            "'text' field. Directories: every *.txt, *.jsonl and *.jsonl.zst below them. "
            "Without --input or --tfds, Python's own documentation is the corpus."
        ),
    )
    parser.add_argument(
        "--input",
        action="append",
        dest="inputs",
        metavar="PATH_OR_GLOB",
        help="input file, glob or directory; repeat for several (default: built-in corpus)",
    )
    parser.add_argument(
        "--tfds",
        action="append",
        default=[],
        metavar="NAME[:SPLIT]",
        help="a TensorFlow Datasets split already prepared in --tfds-data-dir (repeatable)",
    )
    parser.add_argument("--tfds-data-dir", metavar="DIR", help="TensorFlow Datasets data_dir")
    parser.add_argument(
        "--text-key", default="text", help="JSON / TFDS feature holding the text (default text)"
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="output data directory")
    parser.add_argument(
        "--seq-len",
        type=int,
        required=True,
        help=f"tokens per training example (>= {MINIMUM_SEQ_LEN}); packed records hold seq_len + 1",
    )
    parser.add_argument(
        "--format",
        choices=tuple(FORMATS),
        default="packed",
        help="packed: GPT token stream (default); encoder: segment lists for BERT/ALBERT",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help=(
            f"tokenizer vocabulary size (>= {MINIMUM_VOCABULARY_SIZE}, +3 with --format encoder; "
            "an upper bound for wordpiece); required unless --tokenizer"
        ),
    )
    parser.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default="bpe",
        help="tokenizer to train: SentencePiece bpe (default) or unigram, or wordpiece",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="reuse a tokenizer: tokenizer.model, vocab.txt, or a directory holding one",
    )
    parser.add_argument(
        "--shard-size",
        default="1G",
        help="target shard size, e.g. 64K, 10M, 1G (binary units; default 1G)",
    )
    parser.add_argument(
        "--chunk-size",
        help="input bytes per unit of parallel work and resuming (default: 2 x shard size, >= 64M)",
    )
    parser.add_argument(
        "--compression", choices=tuple(COMPRESSIONS), default="none", help="shard compression"
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
        "--workers", type=int, help="processes encoding chunks in parallel (default: all cores)"
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        help="SentencePiece threads per worker (default: cores / workers)",
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
            tokenizer_type=arguments.tokenizer_type,
            shard_size=parse_size(arguments.shard_size, "shard_size"),
            chunk_size=(
                None
                if arguments.chunk_size is None
                else parse_size(arguments.chunk_size, "chunk_size")
            ),
            val_fraction=arguments.val_fraction,
            seed=arguments.seed,
            tokenizer_sample_bytes=parse_size(
                arguments.tokenizer_sample_bytes, "tokenizer_sample_bytes"
            ),
            overwrite=arguments.overwrite,
            num_threads=arguments.num_threads,
            workers=arguments.workers,
            record_format=arguments.format,
            compression=COMPRESSIONS[arguments.compression],
            tfds=arguments.tfds,
            tfds_data_dir=arguments.tfds_data_dir,
            text_key=arguments.text_key,
            interactive_progress=sys.stderr.isatty(),
        )
    except (ValueError, OSError, WorkerDied) as error:
        message = (
            str(error)
            if not isinstance(error, OSError)
            else (f"{error.filename}: {error.strerror}" if error.filename else str(error))
        )
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # SIGTERM (a scheduler's stop) is an interruption like Ctrl-C: finished
    # chunks are kept for the rerun.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
