"""Turn raw text into a tokenizer and sharded TFRecords: `python -m pipelines.prepare`.

Examples:

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

Steps (the module of each in parentheses):

1. Plan (`pipelines.sources`): the inputs are cut into chunks of about
   `--chunk-size` bytes (default: twice `--shard-size`, at least 64 MiB). A
   chunk is the unit of parallel work and of resuming; chunking depends only
   on the inputs.
2. Scan (`scan`, parallel over chunks): hash every document to choose the
   validation documents and the tokenizer's training sample.
3. Tokenizer (`tokenizer_training`): train SentencePiece BPE or unigram
   (byte fallback, see `pipelines.tokenizer`: pad=0, unk=1, eos=2, no bos;
   with `--format encoder` also [CLS]=3, [SEP]=4, [MASK]=5) or WordPiece
   (`pipelines.wordpiece_tokenizer`, same special ids) on a sample of at most
   `--tokenizer-sample-bytes` (default 64 MiB) of training documents: the
   documents with the smallest keyed hashes that fit the budget, a uniform
   sample independent of input order. Or reuse `--tokenizer` (a model file,
   a `vocab.txt`, a Hugging Face byte-level BPE `tokenizer.json`
   (`pipelines.byte_level_tokenizer`), or a directory holding one, e.g. an
   earlier data directory or a Hugging Face model's).
4. Encode and write (`encoding`, `shard_writer`; parallel over chunks,
   `--workers` processes): each chunk's documents are encoded in batches and
   written to that chunk's own shards, rolled at `--shard-size` bytes
   (uncompressed). A split therefore has at least one shard per chunk:
   validation shards hold about `--val-fraction` of a chunk each.
5. Commit (`commit`): the shards are renamed to
   `{split}-{index:05d}-of-{count:05d}.tfrecord` in chunk order, and
   `manifest.json` is written last.

`run.prepare()` runs the steps in order; `resume` holds the state file and
the lock, `progress` the progress line, `cli` the flags
(`python -m pipelines.prepare` runs `cli.main`).

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

`manifest.json`: its keys, the record formats and the file names are
defined once, in `pipelines.manifest`, for this writer and the readers.

Errors are reported as one line `error: ...` on stderr with exit status 2.
"""

from pipelines.prepare.cli import COMPRESSIONS, main, parse_size
from pipelines.prepare.encoding import ENCODE_BATCH_BYTES, MEMORY_BOUND_MB, WorkerDied
from pipelines.prepare.resume import LOCK_FILENAME, STATE_FILENAME
from pipelines.prepare.run import (
    DEFAULT_SEED,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TOKENIZER_SAMPLE_BYTES,
    DEFAULT_VAL_FRACTION,
    MINIMUM_SEQ_LEN,
    prepare,
)
from pipelines.prepare.shard_writer import split_segments
from pipelines.prepare.tokenizer_training import TOKENIZER_TYPES

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_SEED",
    "DEFAULT_SHARD_SIZE",
    "DEFAULT_TOKENIZER_SAMPLE_BYTES",
    "DEFAULT_VAL_FRACTION",
    "ENCODE_BATCH_BYTES",
    "LOCK_FILENAME",
    "MEMORY_BOUND_MB",
    "MINIMUM_SEQ_LEN",
    "STATE_FILENAME",
    "TOKENIZER_TYPES",
    "WorkerDied",
    "main",
    "parse_size",
    "prepare",
    "split_segments",
]
