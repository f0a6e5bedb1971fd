"""GPT-2's byte-level byte-pair-encoding tokenizer, written with TensorFlow ops."""

import json
import os

import tensorflow as tf
import tensorflow_text as tf_text

# Unicode White_Space, the set GPT-2's reference pre-tokenizers treat as `\s`
# (measured against the Hugging Face tokenizer: U+001C..U+001F are not in it).
# Spelled out because RE2's `\s` is ASCII-only.
_WHITESPACE = (
    r"\t\n\x{0B}\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}"
    r"\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}"
)
# GPT-2's pattern is
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# RE2 has no lookahead, so the two whitespace alternatives are left out: the
# text between matches (`regex_split` returns it as tokens too) is then
# exactly a whitespace run, minus its last space when that space starts the
# next word, which is what `\s+(?!\S)` yields. The one case left over, a run
# ending in a non-space whitespace character before a word, is split in
# `_split_trailing_whitespace`.
_WORD_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+"
    rf"| ?[^{_WHITESPACE}\p{{L}}\p{{N}}]+"
)
_SPECIAL_TOKENS = ("<|endoftext|>",)
# Larger than any merge rank; marks "no merge" in the rank table.
_NO_MERGE = 2**31 - 1


def bytes_to_unicode():
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes map to themselves; the others (controls, space)
    are shifted past U+00FF, so no BPE symbol contains whitespace.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + shift)
            shift += 1
    return {byte: chr(character) for byte, character in zip(printable, characters)}


def _static_table(keys, values, default):
    return tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(keys), tf.constant(values)),
        default_value=default,
    )


class BytePairTokenizer(tf.Module):
    """GPT-2's byte-level BPE tokenizer (Radford et al. 2019), in-graph.

    Reads the `vocab.json` and `merges.txt` files of a GPT-2 checkpoint.
    Text is split into words with GPT-2's regular expression, each word's
    UTF-8 bytes are mapped to printable characters, then adjacent symbols are
    merged in the order of `merges.txt`. Every step is a TensorFlow op
    (tensorflow-text's RE2 `regex_split`, hash tables, a `tf.while_loop` for
    the merges), so the tokenizer can be saved inside a SavedModel; the ids
    equal the Hugging Face GPT-2 tokenizer's. Special tokens present in the
    vocabulary (`<|endoftext|>`) are recognised in the text as single ids.

    Args:
        vocabulary: dict[str, int]. Token string to id, as in `vocab.json`.
        merges: list[str]. Merge rules `"left right"`, highest priority
            first, as in `merges.txt` (without its `#version` line).

    Example:
    >>> tokenizer = BytePairTokenizer.from_directory("gpt2")  # doctest: +SKIP
    >>> tokenizer.encode("Hello world")  # doctest: +SKIP
    [15496, 995]
    """

    def __init__(self, vocabulary, merges, name=None):
        super().__init__(name=name)
        if not vocabulary:
            raise ValueError("`vocabulary` is empty. Received: vocabulary={}")
        self.vocabulary = dict(vocabulary)
        self.merges = [" ".join(merge.split()) for merge in merges]
        for index, merge in enumerate(self.merges):
            if len(merge.split(" ")) != 2:
                raise ValueError(
                    "Each merge must be two symbols separated by a space. "
                    f"Received: merges[{index}]={merges[index]!r}"
                )
        ids = list(self.vocabulary.values())
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(
                "`vocabulary` ids must be distinct and non-negative. Received "
                f"{len(ids)} tokens with {len(set(ids))} distinct ids, "
                f"smallest {min(ids)}"
            )
        self.vocabulary_size = max(ids) + 1
        byte_map = bytes_to_unicode()
        missing = [c for c in byte_map.values() if c not in self.vocabulary]
        if missing:
            raise ValueError(
                "`vocabulary` is not a byte-level BPE vocabulary: it lacks "
                f"{len(missing)} of the 256 byte symbols, e.g. {missing[:3]!r}"
            )
        self.special_tokens = [t for t in _SPECIAL_TOKENS if t in self.vocabulary]
        self.eos_id = self.vocabulary.get("<|endoftext|>")

        # Tables are attributes so that a SavedModel holding this module
        # tracks and restores them.
        self._byte_to_symbol = _static_table(
            [bytes([b]) for b in byte_map], list(byte_map.values()), ""
        )
        self._symbol_to_byte = _static_table(
            list(byte_map.values()), [bytes([b]) for b in byte_map], ""
        )
        self._merge_rank = _static_table(
            self.merges, list(range(len(self.merges))), _NO_MERGE
        )
        self._token_to_id = _static_table(
            list(self.vocabulary), list(self.vocabulary.values()), -1
        )
        id_to_token = [""] * self.vocabulary_size
        for token, index in self.vocabulary.items():
            id_to_token[index] = token
        self._id_to_token = tf.constant(id_to_token)
        self._special = tf.constant(self.special_tokens or [""], tf.string)
        if self.special_tokens:
            escaped = "|".join(_re2_escape(token) for token in self.special_tokens)
            self._special_pattern = escaped
            self._word_pattern = f"{escaped}|{_WORD_PATTERN}"
        else:
            self._special_pattern = None
            self._word_pattern = _WORD_PATTERN

    # ---- construction and files ----------------------------------------

    @classmethod
    def from_files(cls, vocabulary_file, merges_file):
        """Builds the tokenizer from GPT-2's `vocab.json` and `merges.txt`."""
        for path in (vocabulary_file, merges_file):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Tokenizer file not found: {path}")
        with open(vocabulary_file, encoding="utf-8") as file:
            vocabulary = json.load(file)
        with open(merges_file, encoding="utf-8") as file:
            lines = file.read().split("\n")
        merges = [line for line in lines if line.strip() and not line.startswith("#version")]
        return cls(vocabulary, merges)

    @classmethod
    def from_directory(cls, directory):
        """Builds the tokenizer from `directory/vocab.json` and `merges.txt`."""
        return cls.from_files(
            os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
        )

    def save(self, directory):
        """Writes `vocab.json` and `merges.txt` to `directory`."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as file:
            json.dump(self.vocabulary, file, ensure_ascii=False)
        with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as file:
            file.write("#version: 0.2\n" + "\n".join(self.merges) + "\n")

    # ---- the interface shared with pipelines.tokenizer.Tokenizer ---------

    def encode(self, text):
        """Returns the ids (list of int) of one string."""
        return self.tokenize(tf.constant([text]))[0].numpy().tolist()

    def decode(self, ids):
        """Returns the text of a list of ids."""
        ids = tf.ragged.constant([list(ids)], dtype=tf.int32, ragged_rank=1)
        return self.detokenize(ids)[0].numpy().decode("utf-8")

    def tf_tokenizer(self):
        """Returns the in-graph tokenizer: `tokenize` and `detokenize` ops."""
        return self

    # ---- in-graph ops ----------------------------------------------------

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def tokenize(self, texts):
        """Returns the ids of a batch of strings, a RaggedTensor (B, None) int32."""
        if self._special_pattern is not None:
            # Special tokens end words on both sides (the Hugging Face
            # tokenizer splits them off before pre-tokenizing).
            pieces = tf_text.regex_split(
                texts, self._special_pattern, self._special_pattern
            )  # (B, pieces)
        else:
            pieces = tf.RaggedTensor.from_tensor(texts[:, tf.newaxis])  # (B, 1)
        words = tf_text.regex_split(
            pieces.flat_values, self._word_pattern, self._word_pattern
        )  # (pieces, words)
        words = _split_trailing_whitespace(words, self._whitespace_run_pattern())
        words = pieces.with_flat_values(words).merge_dims(1, 2)  # (B, words)

        unique_words, word_index = tf.unique(words.flat_values)  # (U,), (N,)
        symbols = self._initial_symbols(unique_words)  # (U, S)
        symbols = self._merge(symbols)  # (U, S)
        symbols = tf.ragged.boolean_mask(symbols, symbols != "")  # (U, None)
        ids = self._token_to_id.lookup(symbols)  # (U, None)
        tf.debugging.assert_non_negative(
            ids.flat_values,
            message="A merged symbol is missing from the vocabulary: "
            "vocab.json and merges.txt do not belong together",
        )
        ids = tf.gather(ids, word_index)  # (N, None)
        ids = words.with_flat_values(ids).merge_dims(1, 2)  # (B, None)
        return tf.cast(ids, tf.int32)

    @tf.function(
        input_signature=[tf.RaggedTensorSpec([None, None], tf.int32, ragged_rank=1)]
    )
    def detokenize(self, ids):
        """Returns the text (B,) of ragged ids (B, None); bad UTF-8 becomes U+FFFD."""
        tf.debugging.assert_less(
            ids.flat_values,
            self.vocabulary_size,
            message="token id outside the vocabulary",
        )
        tf.debugging.assert_non_negative(ids.flat_values, message="negative token id")
        tokens = tf.gather(self._id_to_token, ids)  # (B, None)
        characters = tf.strings.unicode_split(tokens.flat_values, "UTF-8")  # (N, None)
        byte_strings = self._symbol_to_byte.lookup(characters)
        # Special tokens are stored as text, not byte symbols; GPT-2's are
        # printable ASCII, which the byte map leaves unchanged.
        token_bytes = tf.strings.reduce_join(byte_strings, axis=-1)  # (N,)
        text = tf.strings.reduce_join(tokens.with_flat_values(token_bytes), axis=-1)
        return tf.strings.unicode_transcode(
            text, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD
        )

    # ---- helpers -----------------------------------------------------------

    @staticmethod
    def _whitespace_run_pattern():
        return rf"[{_WHITESPACE}]+"

    def _initial_symbols(self, words):
        """Maps each word's bytes to symbols: (U,) -> dense (U, S), "" padded."""
        byte_symbols = self._byte_to_symbol.lookup(tf.strings.bytes_split(words))
        dense = byte_symbols.to_tensor("")  # (U, S')
        dense = tf.pad(dense, [[0, 0], [0, 1]], constant_values="")  # S >= 1
        # A special token is one symbol, its own text.
        is_special = tf.reduce_any(
            words[:, tf.newaxis] == self._special[tf.newaxis, :], axis=1
        )  # (U,)
        first = tf.where(is_special, words, dense[:, 0])  # (U,)
        rest = tf.where(is_special[:, tf.newaxis], "", dense[:, 1:])  # (U, S-1)
        return tf.concat([first[:, tf.newaxis], rest], axis=1)  # (U, S)

    def _merge(self, symbols):
        """Applies the merges by rank until none applies; symbols (U, S)."""

        def merge_best_pair(symbols, _):
            left, right = symbols[:, :-1], symbols[:, 1:]  # (U, S-1)
            ranks = self._merge_rank.lookup(tf.strings.join([left, right], " "))
            ranks = tf.where(right != "", ranks, _NO_MERGE)  # (U, S-1)
            best = tf.reduce_min(ranks, axis=1, keepdims=True)  # (U, 1)
            matches = (ranks == best) & (best < _NO_MERGE)  # (U, S-1)
            # In a run like "a a a" only the first pair of each overlapping
            # run merges now; the rest merges in a later iteration, as the
            # reference's left-to-right scan would.
            follows_match = tf.pad(matches[:, :-1], [[0, 0], [1, 0]])
            starts = matches & ~follows_match  # (U, S-1)
            merged = tf.where(starts, tf.strings.join([left, right]), left)
            merged = tf.concat([merged, symbols[:, -1:]], axis=1)  # (U, S)
            absorbed = tf.pad(starts, [[0, 0], [1, 0]])  # (U, S)
            merged = tf.where(absorbed, "", merged)
            # Close the gaps, keeping the width fixed for the loop.
            merged = tf.ragged.boolean_mask(merged, merged != "")
            merged = merged.to_tensor("", shape=tf.shape(symbols))
            return merged, tf.reduce_any(starts)

        symbols, _ = tf.while_loop(
            lambda symbols, changed: changed,
            merge_best_pair,
            (symbols, tf.constant(True)),
        )
        return symbols


def _re2_escape(text):
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in text)


def _split_trailing_whitespace(words, whitespace_run):
    """Splits the last character off whitespace runs that precede a word.

    `words` (P, None) come from a `regex_split` that leaves whitespace as the
    text between matches. GPT-2's `\\s+(?!\\S)|\\s+` makes a run of two or
    more characters followed by a word two tokens: all but the last
    character, and the last alone. When that last character is a space it
    starts the next word instead, so the text between matches is already
    right. A run that ends the text stays whole.
    """
    flat = words.flat_values  # (N,)
    count = tf.shape(flat, out_type=tf.int64)[0]
    is_last = tf.scatter_nd(
        (words.row_limits() - 1)[words.row_lengths() > 0][:, tf.newaxis],
        tf.ones_like(words.row_limits()[words.row_lengths() > 0], tf.bool),
        [count],
    )  # (N,)
    is_run = tf.strings.regex_full_match(flat, whitespace_run)
    length = tf.strings.length(flat, unit="UTF8_CHAR")
    head = tf.strings.substr(flat, tf.zeros_like(length), length - 1, unit="UTF8_CHAR")
    tail = tf.strings.substr(flat, length - 1, tf.ones_like(length), unit="UTF8_CHAR")
    # When the next word starts with a space, that space was the run's last
    # character and the run is already cut where GPT-2 cuts it.
    following = tf.concat([flat[1:], [""]], axis=0)  # (N,)
    joined_next = tf.strings.substr(following, 0, 1) == " "
    split = is_run & ~is_last & (length > 1) & ~joined_next  # (N,)
    parts = tf.stack([tf.where(split, head, flat), tf.where(split, tail, "")], axis=1)
    parts = tf.ragged.boolean_mask(parts, parts != "")  # (N, 1 or 2)
    return words.with_flat_values(parts).merge_dims(1, 2)
