"""SentencePiece BPE tokenizer shared by data preparation, training and sampling.

The tokenizer is a SentencePiece model (https://github.com/google/sentencepiece,
Kudo & Richardson 2018) trained with byte-pair encoding (Sennrich et al. 2016)
and these fixed choices:

- Special ids: `pad_id = 0` (`<pad>`, never produced by `encode`, for padding
  batches), `unk_id = 1` (`<unk>`, unused in practice because of byte
  fallback), `eos_id = 2` (`<|endoftext|>`, appended after every document when
  the training stream is packed, GPT-2 style). There is no BOS token
  (`bos_id = -1`): one EOS between documents is the only separator.
- `byte_fallback=True`: a character outside the learned vocabulary is encoded
  as its UTF-8 bytes (`<0x00>` ... `<0xFF>`, ids 3 to 258), so any text can be
  encoded without `<unk>`.
- Normalization rule `identity`, no dummy prefix and no whitespace collapsing:
  `decode(encode(text)) == text` exactly, for every text that does not itself
  contain U+2581 (`▁`, SentencePiece's visible-space symbol, which decodes to
  a space). Newlines, tabs and runs of spaces are kept.
- Digits are split into single-digit pieces and whitespace-only pieces (code
  indentation) are allowed.
- Model type: BPE by default, or unigram (Kudo 2018) with `model_type="unigram"`.
- Encoder (BERT/ALBERT) tokenizers, `encoder_special_tokens=True`, also
  reserve `[CLS]` = 3, `[SEP]` = 4 and `[MASK]` = 5 as control pieces (never
  produced by `encode`, even for the literal text "[MASK]"); the byte pieces
  then take ids 6 to 261. The ids are the same for the WordPiece tokenizer
  (`pipelines.wordpiece_tokenizer`), so data and models do not care which
  tokenizer made them.

`Tokenizer.load(path)` accepts a `tokenizer.model` file, a WordPiece
`vocab.txt`, a Hugging Face byte-level BPE `tokenizer.json`, or a directory
holding one (a prepared data directory, to reuse its tokenizer, or a
Hugging Face model directory: `tfgpt.hf_files.tokenizer_file` picks its
file), and returns a `Tokenizer`, a `WordPieceTokenizer` or a
`pipelines.byte_level_tokenizer.ByteLevelTokenizer`: each has `encode`,
`encode_batch`, `decode`, `vocabulary_size`, the special ids (`pad_id`,
`unk_id`, `eos_id`, `bos_id`, `cls_id`, `sep_id`, `mask_id`; -1 when
absent), `settings()`, `save(directory)` and `tf_tokenizer()`.

Example:

>>> tokenizer = train_tokenizer(["some text, more text"] * 20, 270, output_path=None)
>>> ids = tokenizer.encode("some text")
>>> tokenizer.decode(ids)
'some text'
>>> tokenizer.encode_batch(["more", "text"]) == [tokenizer.encode("more"), tokenizer.encode("text")]
True
"""

import functools
import io
import os
from typing import Iterable, List, Optional, Sequence

import sentencepiece

from pipelines.files import write_atomically

PAD_ID = 0
UNK_ID = 1
EOS_ID = 2
BOS_ID = -1  # Disabled: documents are separated by EOS only.
PAD_PIECE = "<pad>"
UNK_PIECE = "<unk>"
EOS_PIECE = "<|endoftext|>"
CLS_PIECE = "[CLS]"
SEP_PIECE = "[SEP]"
MASK_PIECE = "[MASK]"
ENCODER_SPECIAL_PIECES = (CLS_PIECE, SEP_PIECE, MASK_PIECE)  # Ids 3, 4, 5.
MODEL_FILENAME = "tokenizer.model"
MODEL_TYPES = ("bpe", "unigram")

NUMBER_OF_BYTE_PIECES = 256
NUMBER_OF_SPECIAL_PIECES = 3  # pad, unk, eos.
# Every byte needs a piece for byte fallback, plus the special pieces, plus at
# least one learned piece.
MINIMUM_VOCABULARY_SIZE = NUMBER_OF_BYTE_PIECES + NUMBER_OF_SPECIAL_PIECES + 1

# SentencePiece silently skips training sentences longer than
# `max_sentence_length` bytes, so long lines are cut into pieces this long.
MAXIMUM_TRAINING_SENTENCE_BYTES = 16384


def check_text(text) -> str:
    """`text` if it is a str; otherwise a ValueError naming its type."""
    if not isinstance(text, str):
        raise ValueError(f"`text` must be a str. Received: text of type {type(text).__name__}")
    return text


def check_texts(texts: Iterable) -> List[str]:
    """`texts` as a list if every one is a str; otherwise a ValueError naming the first other."""
    texts = list(texts)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(
                f"`texts` must contain only str. Received: texts[{index}] "
                f"of type {type(text).__name__}"
            )
    return texts


def check_ids(ids: Iterable[int], vocabulary_size: int) -> List[int]:
    """`ids` as a list of int if all are in `[0, vocabulary_size)`; otherwise a ValueError."""
    ids = [int(token_id) for token_id in ids]
    for token_id in ids:
        if not 0 <= token_id < vocabulary_size:
            raise ValueError(f"`ids` must be in [0, {vocabulary_size}). Received: id {token_id}")
    return ids


def from_file_contents(cls, contents, path: str):
    """`cls(contents)`, with a ValueError from it prefixed by the file it was read from."""
    try:
        return cls(contents)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


class Tokenizer:
    """A SentencePiece tokenizer with the special ids used across tfgpt.

    Build it with `Tokenizer.load(path)` or `train_tokenizer(...)`.

    Args:
        model_proto: bytes. The serialized SentencePiece model (the contents
            of a `tokenizer.model` file).
        add_bos: bool. Put the model's bos id before every text, in `encode`,
            `encode_batch` and `tf_tokenizer()`, as transformers'
            `LlamaTokenizer` does (its `add_bos_token`) for Llama 2 and
            Mistral. A model without a bos piece (tfgpt's) adds nothing.

    Example:

    >>> tokenizer = Tokenizer.load("data/tokenizer.model")  # doctest: +SKIP
    >>> tokenizer.encode_batch(["Hello", "world"])  # doctest: +SKIP
    [[...], [...]]
    """

    def __init__(self, model_proto: bytes, add_bos: bool = False):
        if not isinstance(model_proto, (bytes, bytearray)) or not model_proto:
            raise ValueError(
                "`model_proto` must be the non-empty bytes of a SentencePiece model. "
                f"Received: model_proto of type {type(model_proto).__name__}"
            )
        self._model_proto = bytes(model_proto)
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(self._model_proto)
        except Exception as error:  # SentencePiece raises RuntimeError/OSError.
            raise ValueError(f"`model_proto` is not a valid SentencePiece model: {error}") from None
        self.add_bos = bool(add_bos) and self._processor.bos_id() >= 0

    filename = MODEL_FILENAME

    @classmethod
    def load(cls, path: str, add_bos: bool = False):
        """Load a tokenizer from a file or a directory.

        Args:
            path: str. A SentencePiece model file, a WordPiece `vocab.txt`, a
                byte-level BPE `tokenizer.json`, or a directory holding one
                (e.g. a prepared data directory, or a Hugging Face model's).
            add_bos: bool. For a SentencePiece model: put its bos id first.

        Returns:
            Tokenizer, `pipelines.wordpiece_tokenizer.WordPieceTokenizer` for
            a WordPiece vocabulary, or
            `pipelines.byte_level_tokenizer.ByteLevelTokenizer`.
        """
        from pipelines import wordpiece_tokenizer
        from pipelines.byte_level_tokenizer import ByteLevelTokenizer
        from tfgpt.hf_files import is_byte_level, tokenizer_file

        if os.path.isdir(path):
            vocabulary_path = os.path.join(path, wordpiece_tokenizer.VOCABULARY_FILENAME)
            found = tokenizer_file(path)
            if os.path.exists(vocabulary_path) and (
                    found is None or found.endswith(".json") and not is_byte_level(found)):
                # (a BERT's directory: WordPiece's tokenizer.json beside its vocab.txt)
                return wordpiece_tokenizer.WordPieceTokenizer.load(vocabulary_path)
            if found is None:
                raise ValueError(
                    f"Cannot find a tokenizer in a directory: it holds neither "
                    f"{MODEL_FILENAME}, {ByteLevelTokenizer.filename} nor "
                    f"{wordpiece_tokenizer.VOCABULARY_FILENAME}. Received: path={path!r}"
                )
            path = found
        if path.endswith(".txt"):
            return wordpiece_tokenizer.WordPieceTokenizer.load(path)
        if path.endswith(".json"):
            return ByteLevelTokenizer.load(path)
        try:
            with open(path, "rb") as model_file:
                model_proto = model_file.read()
        except OSError as error:
            raise ValueError(
                f"Cannot read tokenizer model. Received: path={path!r} ({error.strerror})"
            ) from None
        return from_file_contents(functools.partial(cls, add_bos=add_bos), model_proto, path)

    @property
    def model_proto(self) -> bytes:
        """bytes. The serialized SentencePiece model."""
        return self._model_proto

    @property
    def vocabulary_size(self) -> int:
        """int. Number of token ids, i.e. the embedding table's row count."""
        return self._processor.GetPieceSize()

    @property
    def pad_id(self) -> int:
        """int. Id used to pad batches; -1 if the model has no pad piece."""
        return self._processor.pad_id()

    @property
    def unk_id(self) -> int:
        """int. Id of the unknown piece."""
        return self._processor.unk_id()

    @property
    def eos_id(self) -> int:
        """int. Document-end id appended after every document; -1 if absent."""
        return self._processor.eos_id()

    @property
    def bos_id(self) -> int:
        """int. Beginning-of-sequence id; -1 (disabled) for tfgpt tokenizers."""
        return self._processor.bos_id()

    def _control_id(self, piece: str) -> int:
        token_id = self._processor.PieceToId(piece)
        return token_id if self._processor.IsControl(token_id) and token_id != self.eos_id else -1

    @property
    def cls_id(self) -> int:
        """int. `[CLS]` id (3) of encoder tokenizers; -1 if absent."""
        return self._control_id(CLS_PIECE)

    @property
    def sep_id(self) -> int:
        """int. `[SEP]` id (4) of encoder tokenizers; -1 if absent."""
        return self._control_id(SEP_PIECE)

    @property
    def mask_id(self) -> int:
        """int. `[MASK]` id (5) of encoder tokenizers; -1 if absent."""
        return self._control_id(MASK_PIECE)

    def special_ids(self) -> List[int]:
        """list of int. The ids that are not text: pad, unk, eos, bos, cls, sep, mask if present."""
        ids = [self.pad_id, self.unk_id, self.eos_id, self.bos_id]
        ids += [self.cls_id, self.sep_id, self.mask_id]
        return sorted({token_id for token_id in ids if token_id >= 0})

    def save(self, directory: str) -> str:
        """Write `tokenizer.model` into `directory` (atomically); returns its path."""
        path = os.path.join(directory, MODEL_FILENAME)
        write_atomically(path, self._model_proto)
        return path

    def settings(self) -> dict:
        """The model's type and text-handling settings, for manifests.

        Returns:
            dict with `model_type` (e.g. "bpe"), `byte_fallback`,
            `normalization` (the normalization rule name) and
            `add_dummy_prefix`.
        """
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(self._model_proto)
        return {
            "model_type": sentencepiece_model_pb2.TrainerSpec.ModelType.Name(
                model.trainer_spec.model_type
            ).lower(),
            "byte_fallback": model.trainer_spec.byte_fallback,
            "normalization": model.normalizer_spec.name,
            "add_dummy_prefix": model.normalizer_spec.add_dummy_prefix,
        }

    def id_to_piece(self, token_id: int) -> str:
        """Return the vocabulary piece of one id (for inspection and debugging)."""
        return self._processor.IdToPiece(int(token_id))

    def encode(self, text: str) -> List[int]:
        """Encode one text to ids. No EOS is added; the bos id is with `add_bos`.

        Args:
            text: str.

        Returns:
            list of int.
        """
        return self._processor.Encode(check_text(text), add_bos=self.add_bos)

    def encode_batch(
        self, texts: Sequence[str], num_threads: Optional[int] = None
    ) -> List[List[int]]:
        """Encode several texts in parallel inside SentencePiece. No EOS is added.

        Args:
            texts: sequence of str.
            num_threads: int or None. Encoder threads; None uses every core.

        Returns:
            list of list of int, one per text, in order.
        """
        texts = check_texts(texts)
        if num_threads is None:
            num_threads = os.cpu_count() or 1
        if num_threads < 1:
            raise ValueError(
                f"`num_threads` must be at least 1. Received: num_threads={num_threads}"
            )
        return self._processor.Encode(texts, add_bos=self.add_bos, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text. Special ids (pad, EOS) decode to nothing.

        Args:
            ids: iterable of int, e.g. a list or a 1-D NumPy array.

        Returns:
            str.
        """
        return self._processor.Decode(check_ids(ids, self.vocabulary_size))

    def tf_tokenizer(self):
        """Return an in-graph `tensorflow_text.SentencepieceTokenizer` of this model.

        It is built from the same model bytes and `add_bos`, so its ids
        equal `encode`'s.
        TensorFlow Text is imported only when this is called.

        Returns:
            tensorflow_text.SentencepieceTokenizer with int32 output.
        """
        import tensorflow as tf
        import tensorflow_text

        return tensorflow_text.SentencepieceTokenizer(
            model=self._model_proto, out_type=tf.int32, add_bos=self.add_bos
        )


def _training_sentences(documents: Iterable[str]) -> Iterable[str]:
    """Cut documents into the line-sized "sentences" SentencePiece trains on.

    Newlines therefore never appear inside a training sentence; they are
    encoded with the `<0x0A>` byte piece, one token per newline.
    """
    # A character is at most 4 UTF-8 bytes, so this many characters always fit.
    maximum_characters = MAXIMUM_TRAINING_SENTENCE_BYTES // 4
    for document in documents:
        for line in document.split("\n"):
            if not line.strip():
                continue
            for start in range(0, len(line), maximum_characters):
                yield line[start : start + maximum_characters]


def minimum_vocabulary_size(encoder_special_tokens: bool = False) -> int:
    """Smallest SentencePiece vocabulary: specials + 256 byte pieces + 1 learned piece."""
    return MINIMUM_VOCABULARY_SIZE + (len(ENCODER_SPECIAL_PIECES) if encoder_special_tokens else 0)


def train_tokenizer(
    documents: Iterable[str],
    vocabulary_size: int,
    output_path: Optional[str],
    *,
    num_threads: Optional[int] = None,
    character_coverage: float = 0.9995,
    model_type: str = "bpe",
    encoder_special_tokens: bool = False,
) -> Tokenizer:
    """Train a SentencePiece BPE (or unigram) tokenizer and save it atomically.

    The caller chooses the training sample (`pipelines.prepare` caps it by
    bytes); every document given here is used.

    Args:
        documents: iterable of str. The training texts.
        vocabulary_size: int. Exact size of the resulting vocabulary, at least
            `MINIMUM_VOCABULARY_SIZE` (260: 3 special pieces, 256 byte pieces
            and one learned piece). Very small corpora cannot fill a large
            vocabulary; that is reported as a ValueError.
        output_path: str or None. Where to write the `.model` file (via a
            temporary file in the same directory and a rename); None skips
            saving (`Tokenizer.model_proto` still holds the model).
        num_threads: int or None. Trainer threads; None uses every core.
        character_coverage: float. Fraction of characters (by frequency) that
            get their own piece; rarer characters use byte fallback.
        model_type: str. "bpe" or "unigram".
        encoder_special_tokens: bool. Reserve `[CLS]`, `[SEP]`, `[MASK]` (ids
            3, 4, 5) for encoder pretraining; the minimum size grows by 3.

    Returns:
        Tokenizer. The trained tokenizer, already loaded.
    """
    if isinstance(vocabulary_size, bool) or not isinstance(vocabulary_size, int):
        raise ValueError(
            f"`vocabulary_size` must be an int. Received: vocabulary_size={vocabulary_size!r}"
        )
    minimum = minimum_vocabulary_size(encoder_special_tokens)
    if vocabulary_size < minimum:
        specials = minimum - NUMBER_OF_BYTE_PIECES - 1
        raise ValueError(
            f"`vocabulary_size` must be at least {minimum} "
            f"({specials} special pieces + {NUMBER_OF_BYTE_PIECES} "
            f"byte-fallback pieces + 1). Received: vocabulary_size={vocabulary_size}"
        )
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"`model_type` must be one of {MODEL_TYPES}. Received: model_type={model_type!r}"
        )
    if not 0.0 < character_coverage <= 1.0:
        raise ValueError(
            "`character_coverage` must be in (0, 1]. "
            f"Received: character_coverage={character_coverage}"
        )
    if num_threads is None:
        num_threads = os.cpu_count() or 1

    sentences = list(_training_sentences(documents))
    if not sentences:
        raise ValueError("`documents` contain no non-whitespace text to train on.")

    model_buffer = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.Train(
            sentence_iterator=iter(sentences),
            model_writer=model_buffer,
            model_type=model_type,
            vocab_size=vocabulary_size,
            control_symbols=list(ENCODER_SPECIAL_PIECES) if encoder_special_tokens else [],
            character_coverage=character_coverage,
            byte_fallback=True,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            max_sentence_length=MAXIMUM_TRAINING_SENTENCE_BYTES,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            eos_id=EOS_ID,
            bos_id=BOS_ID,
            pad_piece=PAD_PIECE,
            unk_piece=UNK_PIECE,
            eos_piece=EOS_PIECE,
            num_threads=num_threads,
            minloglevel=2,  # Only errors; the trainer's INFO log is thousands of lines.
        )
    except RuntimeError as error:
        # Typically "INTERNAL: src/trainer_interface.cc(744) [...] Vocabulary size
        # too high (N). Please set it to a value <= M." when the sample has too
        # few distinct pieces; the source location is noise for users.
        reason = str(error).strip().rsplit("] ", 1)[-1].rstrip(".")
        raise ValueError(
            f"SentencePiece could not train a tokenizer with "
            f"vocabulary_size={vocabulary_size} on {len(sentences)} training lines: "
            f"{reason}. Use a smaller --vocab-size or more text."
        ) from None

    model_proto = model_buffer.getvalue()
    if output_path is not None:
        write_atomically(output_path, model_proto)
    return Tokenizer(model_proto)

