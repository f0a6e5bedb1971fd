"""WordPiece tokenizer (BERT's), trained and run with TensorFlow Text.

Training uses `tensorflow_text.tools.wordpiece_vocab.bert_vocab_from_dataset`
(BERT's word splitting, then the WordPiece vocabulary learner) on a sample
of documents; encoding uses `tensorflow_text.FastBertTokenizer` (lower-case,
NFD, accents stripped, punctuation split, `##` continuation pieces), the
linear-time WordPiece of Song et al. 2021.

The vocabulary file is `vocab.txt`, one piece per line, id = line number.
Its first six lines are the special pieces, with the same ids as tfgpt's
SentencePiece encoder tokenizers:

    [PAD] = 0, [UNK] = 1, [EOS] = 2, [CLS] = 3, [SEP] = 4, [MASK] = 5

`[EOS]` separates documents in packed (GPT) data. There is no byte fallback:
a word the vocabulary cannot spell becomes `[UNK]`, and `decode` returns the
lower-cased words joined by single spaces (not the original text).
`vocabulary_size` is an upper bound when training: the learner may return
fewer pieces for a small sample.

TensorFlow is imported when a tokenizer is trained or used, not on import.

Example:

>>> tokenizer = train_wordpiece(["Some text, more text."] * 50, 100)  # doctest: +SKIP
>>> tokenizer.decode(tokenizer.encode("some text"))  # doctest: +SKIP
'some text'
"""

import hashlib
import os
from typing import Iterable, List, Optional, Sequence

from pipelines.files import write_atomically
from pipelines.tokenizer import check_ids, check_text, check_texts, from_file_contents

VOCABULARY_FILENAME = "vocab.txt"
RESERVED_TOKENS = ("[PAD]", "[UNK]", "[EOS]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, EOS_ID, CLS_ID, SEP_ID, MASK_ID = range(len(RESERVED_TOKENS))
# Special pieces, plus room for the characters and some pieces.
MINIMUM_VOCABULARY_SIZE = 64


class WordPieceTokenizer:
    """A WordPiece tokenizer with the interface of `pipelines.tokenizer.Tokenizer`.

    Args:
        vocabulary: sequence of str. The pieces, id = position; must start
            with `RESERVED_TOKENS`.

    Example:

    >>> tokenizer = WordPieceTokenizer.load("data/vocab.txt")  # doctest: +SKIP
    >>> tokenizer.encode_batch(["Hello", "world"])  # doctest: +SKIP
    [[...], [...]]
    """

    filename = VOCABULARY_FILENAME

    def __init__(self, vocabulary: Sequence[str]):
        vocabulary = list(vocabulary)
        if tuple(vocabulary[: len(RESERVED_TOKENS)]) != RESERVED_TOKENS:
            raise ValueError(
                f"`vocabulary` must start with the reserved tokens {list(RESERVED_TOKENS)}. "
                f"Received: {vocabulary[: len(RESERVED_TOKENS)]}"
            )
        if len(set(vocabulary)) != len(vocabulary):
            raise ValueError("`vocabulary` must not repeat a piece.")
        self.vocabulary = vocabulary
        self._tokenizer = None

    @classmethod
    def load(cls, path: str) -> "WordPieceTokenizer":
        """Load `vocab.txt` (one piece per line)."""
        try:
            with open(path, encoding="utf-8") as vocabulary_file:
                vocabulary = vocabulary_file.read().split("\n")
        except OSError as error:
            raise ValueError(
                f"Cannot read WordPiece vocabulary. Received: path={path!r} ({error.strerror})"
            ) from None
        if vocabulary and vocabulary[-1] == "":
            vocabulary.pop()
        return from_file_contents(cls, vocabulary, path)

    @property
    def model_proto(self) -> bytes:
        """bytes. The `vocab.txt` contents (what the manifest's sha256 covers)."""
        return ("\n".join(self.vocabulary) + "\n").encode("utf-8")

    def save(self, directory: str) -> str:
        """Write `vocab.txt` into `directory` (atomically); returns its path."""
        path = os.path.join(directory, VOCABULARY_FILENAME)
        write_atomically(path, self.model_proto)
        return path

    @property
    def vocabulary_size(self) -> int:
        return len(self.vocabulary)

    pad_id = property(lambda self: PAD_ID, doc="int. [PAD] id.")
    unk_id = property(lambda self: UNK_ID, doc="int. [UNK] id.")
    eos_id = property(lambda self: EOS_ID, doc="int. [EOS] id, between packed documents.")
    bos_id = property(lambda self: -1, doc="int. -1: no beginning-of-sequence piece.")
    cls_id = property(lambda self: CLS_ID, doc="int. [CLS] id.")
    sep_id = property(lambda self: SEP_ID, doc="int. [SEP] id.")
    mask_id = property(lambda self: MASK_ID, doc="int. [MASK] id.")

    def special_ids(self) -> List[int]:
        return list(range(len(RESERVED_TOKENS)))

    def settings(self) -> dict:
        """Settings for manifests."""
        return {
            "model_type": "wordpiece",
            "byte_fallback": False,
            "normalization": "lower_case_nfd_strip_accents",
            "add_dummy_prefix": False,
        }

    def id_to_piece(self, token_id: int) -> str:
        return self.vocabulary[int(token_id)]

    def tf_tokenizer(self):
        """The in-graph `tensorflow_text.FastBertTokenizer` (int32 ids)."""
        if self._tokenizer is None:
            import tensorflow as tf
            import tensorflow_text

            self._tokenizer = tensorflow_text.FastBertTokenizer(
                vocab=self.vocabulary,
                token_out_type=tf.int32,
                unknown_token="[UNK]",
                lower_case_nfd_strip_accents=True,
                support_detokenization=True,
            )
        return self._tokenizer

    def encode(self, text: str) -> List[int]:
        return self.encode_batch([check_text(text)])[0]

    def encode_batch(
        self, texts: Sequence[str], num_threads: Optional[int] = None
    ) -> List[List[int]]:
        """Encode several texts (one TensorFlow call); `num_threads` is ignored."""
        import tensorflow as tf

        texts = check_texts(texts)
        if not texts:
            return []
        ragged = self.tf_tokenizer().tokenize(tf.constant(texts))  # (B, pieces)
        if ragged.ragged_rank > 1:  # (B, words, pieces) from the word-splitting variants.
            ragged = ragged.merge_dims(-2, -1)
        return ragged.to_list()

    def decode(self, ids: Iterable[int]) -> str:
        """Lower-cased words joined by spaces; special ids are dropped."""
        import tensorflow as tf

        ids = check_ids(ids, self.vocabulary_size)
        ids = [token_id for token_id in ids if token_id >= len(RESERVED_TOKENS)]
        if not ids:
            return ""
        text = self.tf_tokenizer().detokenize(tf.constant([ids], tf.int32))  # (1,)
        return text[0].numpy().decode("utf-8")

    def sha256(self) -> str:
        return hashlib.sha256(self.model_proto).hexdigest()


def check_vocabulary_size(vocabulary_size) -> None:
    """Raise ValueError unless `vocabulary_size` is an int of at least `MINIMUM_VOCABULARY_SIZE`."""
    if (
        isinstance(vocabulary_size, bool)
        or not isinstance(vocabulary_size, int)
        or vocabulary_size < MINIMUM_VOCABULARY_SIZE
    ):
        raise ValueError(
            f"`vocabulary_size` must be an int of at least {MINIMUM_VOCABULARY_SIZE} for "
            f"WordPiece. Received: vocabulary_size={vocabulary_size!r}"
        )


def train_wordpiece(
    documents: Iterable[str], vocabulary_size: int, output_path: Optional[str] = None
) -> WordPieceTokenizer:
    """Learn a WordPiece vocabulary with TensorFlow Text's BERT vocabulary builder.

    Args:
        documents: iterable of str. The training sample (all of it is used).
        vocabulary_size: int. Upper bound of the vocabulary size, at least
            `MINIMUM_VOCABULARY_SIZE`.
        output_path: str or None. Where to write `vocab.txt`.

    Returns:
        WordPieceTokenizer.
    """
    check_vocabulary_size(vocabulary_size)
    import tensorflow as tf
    from tensorflow_text.tools.wordpiece_vocab import bert_vocab_from_dataset

    documents = [document for document in documents if document.strip()]
    if not documents:
        raise ValueError("`documents` contain no non-whitespace text to train on.")
    dataset = tf.data.Dataset.from_tensor_slices(documents).batch(256)
    vocabulary = bert_vocab_from_dataset.bert_vocab_from_dataset(
        dataset,
        vocab_size=vocabulary_size,
        reserved_tokens=list(RESERVED_TOKENS),
        bert_tokenizer_params={"lower_case": True},
        learn_params={},
    )
    tokenizer = WordPieceTokenizer(vocabulary[:vocabulary_size])
    if output_path is not None:
        write_atomically(output_path, tokenizer.model_proto)
    return tokenizer
