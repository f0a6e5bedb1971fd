"""Step 3 of `pipelines.prepare`: train the tokenizer on the scan's sample, or load one.

SentencePiece BPE or unigram (`pipelines.tokenizer`) or WordPiece
(`pipelines.wordpiece_tokenizer`, which imports TensorFlow when it trains
or encodes). A reused tokenizer (`--tokenizer`) must have an EOS piece,
match `--vocab-size` if given, and have [CLS], [SEP] and [MASK] for
`--format encoder`; a Hugging Face model's byte-level BPE `tokenizer.json`
(`pipelines.byte_level_tokenizer`) is reused as it is. Until the commit the
tokenizer lives in the output directory as `.tokenizer.model.tmp`,
`.vocab.txt.tmp` or `.tokenizer.json.tmp`, where workers and a resumed run
load it (a `tokenizer.json` with the end-of-text token it was loaded with).
"""

import os

from pipelines.byte_level_tokenizer import ByteLevelTokenizer
from pipelines.tokenizer import MODEL_FILENAME, Tokenizer, train_tokenizer
from pipelines.wordpiece_tokenizer import (
    VOCABULARY_FILENAME,
    WordPieceTokenizer,
    train_wordpiece,
)

TOKENIZER_TYPES = ("bpe", "unigram", "wordpiece")
# What a data directory's `model_file` can be, and its name until the commit.
TOKENIZER_FILENAMES = (MODEL_FILENAME, VOCABULARY_FILENAME, ByteLevelTokenizer.filename)
TEMPORARY_TOKENIZER_NAMES = tuple(f".{name}.tmp" for name in TOKENIZER_FILENAMES)


def temporary_path(directory: str, tokenizer) -> str:
    """Where the tokenizer waits for the commit: `.{its filename}.tmp`."""
    return os.path.join(directory, f".{tokenizer.filename}.tmp")


def has_encoder_pieces(tokenizer) -> bool:
    """True if the tokenizer has [CLS], [SEP] and [MASK] (needed by `--format encoder`)."""
    return min(tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id) >= 0


def train(sample, tokenizer_type, vocabulary_size, num_threads, encoder):
    """Train a tokenizer on the sample; for `encoder` data it reserves [CLS], [SEP], [MASK]."""
    if tokenizer_type == "wordpiece":
        return train_wordpiece(sample, vocabulary_size)
    return train_tokenizer(
        sample,
        vocabulary_size,
        None,
        num_threads=num_threads,
        model_type=tokenizer_type,
        encoder_special_tokens=encoder,
    )


def load_reused(tokenizer_path, vocabulary_size, record_format):
    """The tokenizer at `--tokenizer`, checked against the flags."""
    tokenizer = Tokenizer.load(tokenizer_path)
    if tokenizer.eos_id < 0:
        raise ValueError(f"{tokenizer_path}: the tokenizer has no EOS piece (eos_id=-1)")
    if vocabulary_size is not None and vocabulary_size != tokenizer.vocabulary_size:
        raise ValueError(
            f"`vocabulary_size` must match the tokenizer at {tokenizer_path}. "
            f"Received: vocabulary_size={vocabulary_size}, tokenizer has "
            f"{tokenizer.vocabulary_size}"
        )
    if record_format == "encoder" and not has_encoder_pieces(tokenizer):
        raise ValueError(
            f"{tokenizer_path}: --format encoder needs a tokenizer with [CLS], [SEP] and "
            "[MASK] pieces; train one with --format encoder or use --tokenizer-type wordpiece"
        )
    return tokenizer


def eos_token(tokenizer):
    """What `load_temporary` needs besides the file: a `tokenizer.json`'s
    end-of-text token (the files beside it named it); None for the others."""
    return getattr(tokenizer, "eos_piece", None)


def load_temporary(path: str, eos: str = None):
    """Load `.tokenizer.model.tmp`, `.vocab.txt.tmp` or `.tokenizer.json.tmp`
    (with its end-of-text token `eos`) by its name."""
    if os.path.basename(path) == f".{VOCABULARY_FILENAME}.tmp":
        return WordPieceTokenizer.load(path)
    if os.path.basename(path) == f".{ByteLevelTokenizer.filename}.tmp":
        return ByteLevelTokenizer(path, eos)
    return Tokenizer.load(path)
