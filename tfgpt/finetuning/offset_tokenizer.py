"""Token ids with the characters each token covers, for SQuAD and classification.

`tfgpt.finetuning.squad.squad_features` needs `encode_with_offsets(text)` and
the `cls_id`, `sep_id` and `pad_id` of the encoder's tokenizer;
`tfgpt.finetuning.classification.encode_classification` needs `encode(text)`
and the same ids. `OffsetTokenizer.load(path)` provides both for the
tokenizers an encoder can come with:

- a SentencePiece model: `tokenizer.model` (tfgpt's encoder tokenizers,
  `pipelines.tokenizer`) or `spiece.model` (Hugging Face ALBERT);
- a WordPiece `vocab.txt`: tfgpt's (`pipelines.wordpiece_tokenizer`) or
  Hugging Face BERT's, with `do_lower_case` from `tokenizer_config.json`
  beside it (default true).

The special ids are looked up by piece (`[CLS]`, `[SEP]`, and `<pad>` or
`[PAD]`), so both tfgpt's layout (3, 4, 0) and the Hugging Face ones
(BERT 101, 102, 0; ALBERT 2, 3, 0) work. The ids of `encode` equal those of
`pipelines.tokenizer.Tokenizer.load(path).encode` for tfgpt tokenizers.

Offsets are character offsets into the text (SentencePiece and TensorFlow
Text report UTF-8 byte offsets). SentencePiece's byte-fallback pieces of one
character (`<0xE2>`, `<0x98>`, `<0x83>` for "☃") all cover that character.

Example:
>>> tokenizer = OffsetTokenizer.load("runs/albert-pretrain")  # doctest: +SKIP
>>> tokenizer.encode_with_offsets("Denver won")  # doctest: +SKIP
([312, 270, 401], [(0, 6), (6, 7), (7, 10)])
"""

import bisect
import json
import os

SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model")
WORDPIECE_FILE = "vocab.txt"
# Hugging Face keeps the casing of a WordPiece vocabulary here.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _find_tokenizer_file(path):
    if not os.path.isdir(path):
        if not os.path.exists(path):
            raise ValueError(f"Tokenizer not found. Received: path={path!r}")
        return path
    for name in SENTENCEPIECE_FILES + (WORDPIECE_FILE,):
        candidate = os.path.join(path, name)
        if os.path.exists(candidate):
            return candidate
    raise ValueError(
        f"{path} holds no tokenizer: expected one of "
        f"{', '.join(SENTENCEPIECE_FILES + (WORDPIECE_FILE,))}"
    )


def _byte_to_char_offsets(text, byte_spans):
    """Turns (begin, end) UTF-8 byte offsets of `text` into character offsets.

    A zero-width span (a byte-fallback piece before the last byte of its
    character) becomes the character it starts in.
    """
    char_starts = []  # Byte offset at which each character starts.
    position = 0
    for character in text:
        char_starts.append(position)
        position += len(character.encode("utf-8"))
    offsets = []
    for begin, end in byte_spans:
        first = max(bisect.bisect_right(char_starts, begin) - 1, 0)
        last = bisect.bisect_left(char_starts, end)  # characters starting before `end`
        if last <= first:
            last = min(first + 1, len(text))
        offsets.append((first, last))
    return offsets


class OffsetTokenizer:
    """A SentencePiece or WordPiece tokenizer that also returns character offsets.

    Build it with `OffsetTokenizer.load(path)`.

    Args:
        path: str. The tokenizer file (`*.model` or `vocab.txt`).
        kind: str. `"sentencepiece"` or `"wordpiece"`.
        model: the loaded tokenizer: a `sentencepiece.SentencePieceProcessor`
            or a `tensorflow_text.FastBertTokenizer`.
        special_id: callable piece -> its id, or None if the vocabulary
            has no such special piece.
        vocabulary_size: int.

    Attributes: `cls_id`, `sep_id`, `pad_id` (ints), `vocabulary_size`,
    `path`.
    """

    def __init__(self, path, kind, model, special_id, vocabulary_size):
        self.path = path
        self.kind = kind
        self._model = model
        self.vocabulary_size = vocabulary_size
        found = {}
        for name, candidates in (
            ("cls_id", ("[CLS]",)),
            ("sep_id", ("[SEP]",)),
            ("pad_id", ("<pad>", "[PAD]")),
        ):
            ids = [special_id(piece) for piece in candidates]
            found[name] = next((token_id for token_id in ids if token_id is not None), None)
            if found[name] is None:
                raise ValueError(
                    f"{path}: not an encoder tokenizer, it has no {' or '.join(candidates)} "
                    "piece (prepare encoder data with `pipelines.prepare --format encoder`)"
                )
        self.cls_id, self.sep_id, self.pad_id = found["cls_id"], found["sep_id"], found["pad_id"]

    @classmethod
    def load(cls, path):
        """Loads the tokenizer file `path`, or the one in directory `path`."""
        path = _find_tokenizer_file(str(path))
        if path.endswith(".txt"):
            return cls._load_wordpiece(path)
        return cls._load_sentencepiece(path)

    @classmethod
    def _load_sentencepiece(cls, path):
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor()
        try:
            with open(path, "rb") as file:
                processor.LoadFromSerializedProto(file.read())
        except OSError as error:
            raise ValueError(f"Cannot read tokenizer {path} ({error.strerror})") from None
        except Exception as error:  # SentencePiece raises RuntimeError.
            raise ValueError(f"{path}: not a SentencePiece model ({error})") from None

        def special_id(piece):
            # PieceToId returns the unknown id for a piece it does not have.
            token_id = processor.PieceToId(piece)
            return None if token_id == processor.unk_id() else token_id

        return cls(path, "sentencepiece", processor, special_id, processor.GetPieceSize())

    @classmethod
    def _load_wordpiece(cls, path):
        import tensorflow as tf
        import tensorflow_text

        try:
            with open(path, encoding="utf-8") as file:
                vocabulary = file.read().split("\n")
        except OSError as error:
            raise ValueError(f"Cannot read tokenizer {path} ({error.strerror})") from None
        if vocabulary and vocabulary[-1] == "":
            vocabulary.pop()
        lower_case = True
        config_path = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_FILE)
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as file:
                lower_case = bool(json.load(file).get("do_lower_case", True))
        if "[UNK]" not in vocabulary:
            raise ValueError(f"{path}: a WordPiece vocabulary needs an [UNK] piece")
        # The settings of pipelines.wordpiece_tokenizer, so the ids agree.
        model = tensorflow_text.FastBertTokenizer(
            vocab=vocabulary,
            token_out_type=tf.int32,
            unknown_token="[UNK]",
            lower_case_nfd_strip_accents=lower_case,
        )
        ids = {piece: token_id for token_id, piece in enumerate(vocabulary)}
        return cls(path, "wordpiece", model, ids.get, len(vocabulary))

    def _encode_bytes(self, text):
        """(ids, [(byte begin, byte end)]) of `text`."""
        if not isinstance(text, str):
            raise ValueError(f"`text` must be a str. Received: text of type {type(text).__name__}")
        if self.kind == "sentencepiece":
            from sentencepiece import sentencepiece_pb2

            proto = sentencepiece_pb2.SentencePieceText()
            # "serialized_proto" is accepted by SentencePiece 0.1.9x and 0.2.x alike.
            proto.ParseFromString(self._model.encode(text, out_type="serialized_proto"))
            return [p.id for p in proto.pieces], [(p.begin, p.end) for p in proto.pieces]
        import tensorflow as tf

        ids, starts, ends = self._model.tokenize_with_offsets(tf.constant([text]))
        # (1, pieces) or (1, words, pieces), depending on the word splitting.
        ids, starts, ends = (
            t.merge_dims(1, -1)[0].numpy().tolist() if t.ragged_rank > 1 else t[0].numpy().tolist()
            for t in (ids, starts, ends)
        )
        return ids, list(zip(starts, ends))

    def encode(self, text):
        """Token ids of `text` (no special tokens)."""
        return self._encode_bytes(text)[0]

    def encode_with_offsets(self, text):
        """`(ids, offsets)`: `offsets[i] = (start, end)`, the characters of token i."""
        ids, byte_spans = self._encode_bytes(text)
        return ids, _byte_to_char_offsets(text, byte_spans)
