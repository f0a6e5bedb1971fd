"""A Hugging Face byte-level BPE `tokenizer.json` as data preparation's tokenizer.

GPT-2, GPT-J, GPT-NeoX, Llama 3 and Qwen2 ship one; `--tokenizer HF_DIR`
(or its `tokenizer.json`) makes `pipelines.prepare` encode with it, so a
model keeps its own ids when it is fine-tuned. The ids are those of
`tfgpt.tokenizers.BytePairTokenizer` (TensorFlow ops, equal to the
`tokenizers` library's), without what the post-processor adds around a
text (Llama 3's `<|begin_of_text|>`): the records are cut and joined
from pieces, and a chat template writes its own `bos_token`.

The special ids: the end-of-text id is the directory's (`eos_token` of
`tokenizer_config.json`, else `eos_token_id` of `config.json`, else a data
directory's manifest: `tfgpt.tokenizers.tokenizer_json.configured_eos`),
or `<|endoftext|>` when it is an added token. There is no pad, unknown,
[CLS], [SEP] or [MASK] id (-1): records are padded with id 0 at loss
weight 0 by their readers, whatever the tokenizer.

It has the interface of `pipelines.tokenizer.Tokenizer`; `model_proto` is
the bytes of `tokenizer.json`, so a data directory's tokenizer hash is the
file's own. TensorFlow is imported when one is loaded.
"""

import os
from typing import Iterable, List, Optional, Sequence

from pipelines.files import write_atomically
from tfgpt.hf_files import TOKENIZER_JSON_FILE


class ByteLevelTokenizer:
    """A byte-level BPE `tokenizer.json` with `pipelines.tokenizer.Tokenizer`'s interface.

    Build it with `ByteLevelTokenizer.load(path)` (or `Tokenizer.load`).

    Args:
        path: str. The `tokenizer.json` file (or its temporary copy).
        eos_token: str or None. The end-of-text token; None takes the one
            the files beside `path` name (see the module docstring).

    Example:

    >>> tokenizer = ByteLevelTokenizer.load("checkpoints/gpt2")  # doctest: +SKIP
    >>> tokenizer.encode("Hello world"), tokenizer.eos_id  # doctest: +SKIP
    ([15496, 995], 50256)
    """

    filename = TOKENIZER_JSON_FILE

    def __init__(self, path: str, eos_token: Optional[str] = None):
        from tfgpt.tokenizers.byte_pair_tokenizer import BytePairTokenizer
        from tfgpt.tokenizers.tokenizer_json import read_tokenizer_json

        arguments = read_tokenizer_json(path, eos_token)  # (its errors name the file)
        try:
            self._tokenizer = BytePairTokenizer(**arguments)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        with open(path, "rb") as file:
            self._model_proto = file.read()
        self._pieces = {index: token for token, index in
                        {**self._tokenizer.vocabulary, **self._tokenizer.special_tokens}.items()}

    @classmethod
    def load(cls, path: str, eos_token: Optional[str] = None) -> "ByteLevelTokenizer":
        """The tokenizer of a `tokenizer.json` file, or of a directory holding one."""
        if os.path.isdir(path):
            path = os.path.join(path, TOKENIZER_JSON_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"Cannot read tokenizer. Received: path={path!r} (no such file)")
        return cls(path, eos_token)

    @property
    def model_proto(self) -> bytes:
        """bytes. The `tokenizer.json` file's."""
        return self._model_proto

    @property
    def vocabulary_size(self) -> int:
        """int. Number of token ids, added tokens included."""
        return self._tokenizer.vocabulary_size

    pad_id = unk_id = cls_id = sep_id = mask_id = -1

    @property
    def eos_id(self) -> int:
        """int. The end-of-text id; -1 when the files name none."""
        return -1 if self._tokenizer.eos_id is None else self._tokenizer.eos_id

    @property
    def bos_id(self) -> int:
        """int. The id the post-processor puts first (Llama 3's `<|begin_of_text|>`),
        which `encode` leaves out; -1 when none."""
        return -1 if self._tokenizer.bos_id is None else self._tokenizer.bos_id

    @property
    def eos_piece(self) -> Optional[str]:
        """str or None. The end-of-text token."""
        return self._pieces.get(self.eos_id)

    def special_ids(self) -> List[int]:
        """list of int. The added tokens' ids."""
        return sorted(self._tokenizer.special_tokens.values())

    def save(self, directory: str) -> str:
        """Write `tokenizer.json` into `directory` (atomically); returns its path."""
        path = os.path.join(directory, TOKENIZER_JSON_FILE)
        write_atomically(path, self._model_proto)
        return path

    def settings(self) -> dict:
        """The manifest's description of its text handling (see `pipelines.manifest`)."""
        return {"model_type": "byte-level-bpe", "byte_fallback": False,
                "normalization": (self._tokenizer.normalization or "identity").lower(),
                "add_dummy_prefix": False}

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary token (byte symbols) or added token of one id."""
        return self._pieces.get(int(token_id), "")

    def encode(self, text: str) -> List[int]:
        """The ids of one text, without the post-processor's."""
        return self.encode_batch([text])[0]

    def encode_batch(
        self, texts: Sequence[str], num_threads: Optional[int] = None
    ) -> List[List[int]]:
        """The ids of each text, without the post-processor's; `num_threads` is TensorFlow's."""
        import tensorflow as tf

        from pipelines.tokenizer import check_texts

        texts = check_texts(texts)
        if not texts:
            return []
        ids = self._tokenizer.tokenize(tf.constant(texts, tf.string)).to_list()
        start, tail = len(self._tokenizer.prefix_ids), len(self._tokenizer.suffix_ids)
        return [row[start:len(row) - tail] for row in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`."""
        from pipelines.tokenizer import check_ids

        return self._tokenizer.decode(check_ids(ids, self.vocabulary_size))

    def tf_tokenizer(self):
        """The in-graph `tfgpt.tokenizers.BytePairTokenizer` (its `tokenize` adds the
        post-processor's ids)."""
        return self._tokenizer
