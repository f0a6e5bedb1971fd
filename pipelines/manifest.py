"""What a data directory holds: `manifest.json`'s schema, record formats, file names.

`python -m pipelines.prepare` writes a data directory; `pipelines.reader`
and `pipelines.encoder_data` read it. Both sides take the format names,
features, versions and file names from this module, and its `Manifest`
declares every key the writer writes (a test holds the writer to it), so
each is spelled once. The tokenizer's file is named by its class
(`pipelines.tokenizer`, `pipelines.wordpiece_tokenizer`). Importing this
module imports nothing outside the standard library.

A data directory:

    manifest.json                       written last: without it, not a dataset
    tokenizer.model or vocab.txt        the SentencePiece model or WordPiece vocabulary
    train-00000-of-00012.tfrecord ...   the shards, `{split}-{index:05d}-of-{count:05d}.tfrecord`
    val-00000-of-00001.tfrecord ...

Record formats (the manifest's `format`, chosen by `prepare --format`):

- `packed` ("tfgpt-packed-tokens", GPT): a `tf.train.Example` with one
  int64 feature `input_ids` of `record_length = seq_len + 1` tokens.
- `encoder` ("tfgpt-encoder-segments", BERT/ALBERT): an Example with int64
  features `token_ids` (a document's consecutive segments back to back, at
  most `record_length = seq_len - 3` tokens) and `segment_lengths`.
- `instructions` ("tfgpt-instruction-examples", fine-tuning a GPT): one
  example per record, an Example with int64 features `token_ids` (the
  prompt's tokens, the completion's, then EOS: at most `record_length =
  seq_len + 1`) and `learned` (1 where the token is one the model learns to
  predict, the completion's and the EOS; 0 for the prompt's). With
  `prepare --pack` (the manifest's `packed`: true) a record holds several
  examples back to back, at most `record_length` tokens in all, and a third
  int64 feature `segment_ids`: each token's example, 1, 2, ... in the record.

`format_version` is 1 for uncompressed packed data (what the first readers
understood), 3 for packed instruction examples (a reader that does not know
`segment_ids` would let one example attend to another) and 2 for anything
else; a reader refuses other versions.

The manifest's keys are the fields of `Manifest`, in the order written,
with `TokenizerDescription`, `Split`, `Shard` and `Totals` nested in it.
"""

import re
from typing import Dict, List, NotRequired, Optional, TypedDict

MANIFEST_FILENAME = "manifest.json"
SPLITS = ("train", "val")

PACKED_FORMAT = "tfgpt-packed-tokens"
ENCODER_FORMAT = "tfgpt-encoder-segments"
INSTRUCTION_FORMAT = "tfgpt-instruction-examples"
# `prepare --format` value -> the manifest's `format`.
RECORD_FORMATS = {"packed": PACKED_FORMAT, "encoder": ENCODER_FORMAT,
                  "instructions": INSTRUCTION_FORMAT}
PACKED_FEATURE = "input_ids"
ENCODER_FEATURES = ("token_ids", "segment_lengths")
INSTRUCTION_FEATURES = ("token_ids", "learned")
# Packed instruction records: each token's example, numbered from 1 in its record.
SEGMENT_FEATURE = "segment_ids"
# `prepare --too-long`: what happens to an example longer than a record.
TOO_LONG_CHOICES = ("drop", "truncate")
LEARN_CHOICES = ("completions", "all")
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)
# The manifest's `compression`: TFRecord compression types as TensorFlow names them.
COMPRESSIONS = (None, "GZIP")

SHARD_FILENAME_PATTERN = re.compile(rf"^({'|'.join(SPLITS)})-\d{{5}}-of-\d{{5}}\.tfrecord$")


def shard_filename(split: str, index: int, count: int) -> str:
    """The final name of a split's shard `index` of `count`: `train-00003-of-00012.tfrecord`."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def format_version(record_format: str, compression: Optional[str], pack: bool = False) -> int:
    """1 for uncompressed packed data, 3 for packed instruction examples, otherwise 2.

    Args:
        record_format: str. A key of `RECORD_FORMATS`.
        compression: None or "GZIP".
        pack: bool. Instruction examples packed several to a record (`--pack`).
    """
    if record_format == "instructions" and pack:
        return 3
    return 1 if record_format == "packed" and compression is None else 2


def record_feature(record_format: str) -> str:
    """The manifest's `feature`: the int64 feature holding a record's tokens."""
    return PACKED_FEATURE if record_format == "packed" else "token_ids"


class Shard(TypedDict):
    """One shard file of a split.

    Keys:
        filename: str. `shard_filename(split, index, count)`.
        sequences: int. Records in the file.
        tokens: int. Tokens in those records.
        bytes: int. The file's size on disk (compressed, if it is).
        sha256: str. Hex SHA-256 of the file.
        chunk: int. The input chunk the records came from.
    """

    filename: str
    sequences: int
    tokens: int
    bytes: int
    sha256: str
    chunk: int


class Split(TypedDict):
    """`splits.train` or `splits.val`.

    Keys:
        documents: int.
        tokens: int. For packed data `sequences * record_length +
            dropped_tail_tokens`.
        sequences: int. Records.
        dropped_tail_tokens: int. Each chunk's partial last record (packed),
            records of fewer than 2 tokens (encoder), or the tokens of
            examples dropped and the ends of examples cut (instructions).
        segments: int. Encoder data only: segments in the records.
        learned_tokens: int. Instruction data only: targets learned (the
            completions' tokens and their EOS; an example's first token is
            no one's target).
        dropped_examples, truncated_examples: int. Instruction data only:
            examples longer than a record, left out or cut (`--too-long`).
        fill: float. Packed instruction data only: the share of the
            records' `sequences * record_length` token slots that hold an
            example's token (the rest is padding).
        shards: list of `Shard`, in reading order.
    """

    documents: int
    tokens: int
    sequences: int
    dropped_tail_tokens: int
    segments: NotRequired[int]
    learned_tokens: NotRequired[int]
    dropped_examples: NotRequired[int]
    truncated_examples: NotRequired[int]
    fill: NotRequired[float]
    shards: List[Shard]


class TokenizerDescription(TypedDict):
    """The manifest's `tokenizer`: how to load it and its special ids.

    Keys:
        type: str. "sentencepiece", "wordpiece" or "byte-level-bpe" (a
            Hugging Face `tokenizer.json`, `pipelines.byte_level_tokenizer`).
        model_type: str. "bpe", "unigram", "wordpiece" or "byte-level-bpe".
        byte_fallback: bool.
        normalization: str. The normalization rule's name.
        add_dummy_prefix: bool.
        model_file: str. "tokenizer.model", "vocab.txt" or "tokenizer.json", in
            the directory.
        sha256: str. Hex SHA-256 of that file.
        vocabulary_size: int.
        pad_id, unk_id, bos_id, eos_id: int. -1 when absent (a
            `tokenizer.json`'s eos is its model directory's, and it has no
            pad: readers pad records with id 0 at loss weight 0).
        eos_piece: str.
        cls_id, sep_id, mask_id: int. -1 when absent (packed-only tokenizers).
        trained: bool. True if prepare trained it, False if reused.
        source: str or None. The reused tokenizer's absolute path.
        sample_documents, sample_bytes: int or None. The training sample.
    """

    type: str
    model_type: str
    byte_fallback: bool
    normalization: str
    add_dummy_prefix: bool
    model_file: str
    sha256: str
    vocabulary_size: int
    pad_id: int
    unk_id: int
    bos_id: int
    eos_id: int
    eos_piece: str
    cls_id: int
    sep_id: int
    mask_id: int
    trained: bool
    source: Optional[str]
    sample_documents: Optional[int]
    sample_bytes: Optional[int]


class Totals(TypedDict):
    """The manifest's `totals`, over both splits and every input.

    Keys:
        documents, input_bytes, skipped_empty_documents, tokens, sequences,
        dropped_tail_tokens: int.
    """

    documents: int
    input_bytes: int
    skipped_empty_documents: int
    tokens: int
    sequences: int
    dropped_tail_tokens: int


class Manifest(TypedDict):
    """The contents of `manifest.json`.

    Keys:
        format: str. A value of `RECORD_FORMATS`.
        format_version: int. `format_version(record_format, compression)`.
        feature: str. `record_feature(record_format)`.
        seq_len: int. The model's context length.
        record_length: int. `seq_len + 1` (packed: every record;
            instructions: the most tokens of an example) or `seq_len - 3`
            (encoder; the most tokens of a record).
        too_long: str. Instruction data only: `--too-long`.
        learn: str. Instruction data only: `--learn` (what is learned:
            "completions", or "all" of every example).
        chat_template: dict. Instruction data only: the chat template of
            "messages" (`pipelines.chat_template.ChatTemplate.spec`).
        packed: bool. Instruction data only: several examples to a record,
            each token's example in `segment_ids` (`--pack`).
        compression: None or "GZIP".
        tokenizer: `TokenizerDescription`.
        splits: dict. "train" and "val", each a `Split`.
        totals: `Totals`.
        inputs: list of str. Absolute input paths, `tfds:NAME:SPLIT`, or
            the built-in corpus's description.
        input_patterns: list of str or None. `--input` as given.
        tfds: list of str or None. `--tfds` as given.
        seed, val_fraction, shard_size, chunk_size: the flags' values.
        chunks: int. Number of input chunks.
        split_rule: str. How a document's split was decided, in words.
    """

    format: str
    format_version: int
    feature: str
    seq_len: int
    record_length: int
    too_long: NotRequired[str]
    learn: NotRequired[str]
    chat_template: NotRequired[dict]
    packed: NotRequired[bool]
    compression: Optional[str]
    tokenizer: TokenizerDescription
    splits: Dict[str, Split]
    totals: Totals
    inputs: List[str]
    input_patterns: Optional[List[str]]
    tfds: Optional[List[str]]
    seed: int
    val_fraction: float
    shard_size: int
    chunk_size: int
    chunks: int
    split_rule: str
