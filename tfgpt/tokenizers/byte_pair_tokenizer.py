"""Byte-level BPE tokenizers (GPT-2, GPT-J, GPT-NeoX, Llama 3, Qwen2) in TensorFlow ops."""

import json
import os

import tensorflow as tf
import tensorflow_text as tf_text

from tfgpt.tokenizers.tokenizer_json import (
    GPT2_SPLIT_PATTERN,
    LLAMA3_SPLIT_PATTERN,
    QWEN2_SPLIT_PATTERN,
    read_tokenizer_json,
)

# Unicode White_Space, the set GPT-2's reference pre-tokenizers treat as `\s`
# (measured against the Hugging Face tokenizer: U+001C..U+001F are not in it).
# Spelled out because RE2's `\s` is ASCII-only.
_NEWLINES = r"\n\r"
_WHITESPACE_BUT_NEWLINES = (
    r"\t\x{0B}\f \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}"
    r"\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}"
)
_WHITESPACE = _NEWLINES + _WHITESPACE_BUT_NEWLINES

# The pre-tokenizer patterns tfgpt runs are those tokenizer.json spells
# (`tfgpt.tokenizers.tokenizer_json`). All three end in `\s+(?!\S)|\s+`, and
# RE2 has no lookahead, so those two whitespace alternatives are left out of
# the RE2 pattern: the text between matches (`regex_split` returns it as tokens
# too) is then a whitespace run, and `_split_trailing_whitespace` cuts it
# where `\s+(?!\S)|\s+` would (see there).


class _SplitPattern:
    """A pre-tokenizer pattern in RE2: the word alternatives and the gaps.

    Args:
        words: str. The pattern's alternatives before `\\s+(?!\\S)|\\s+`, in RE2.
        gap: str. A character class (without brackets) the text between two
            matches is made of. For GPT-2 that is any whitespace. Llama 3's
            `\\s*[\\r\\n]+` matches from the first whitespace character of any
            run holding a newline, so its gaps never hold one, and a
            whitespace-only match (which holds one) is told from a gap by that.
    """

    def __init__(self, words, gap):
        self.words = words
        self.gap = gap


_SPLIT_PATTERNS = {
    GPT2_SPLIT_PATTERN: _SplitPattern(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+"
        rf"| ?[^{_WHITESPACE}\p{{L}}\p{{N}}]+",
        _WHITESPACE,
    ),
    LLAMA3_SPLIT_PATTERN: _SplitPattern(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        rf"| ?[^{_WHITESPACE}\p{{L}}\p{{N}}]+[\r\n]*|[{_WHITESPACE}]*[\r\n]+",
        _WHITESPACE_BUT_NEWLINES,
    ),
    QWEN2_SPLIT_PATTERN: _SplitPattern(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        rf"| ?[^{_WHITESPACE}\p{{L}}\p{{N}}]+[\r\n]*|[{_WHITESPACE}]*[\r\n]+",
        _WHITESPACE_BUT_NEWLINES,
    ),
}
NORMALIZATIONS = (None, "NFC")
_SPECIAL_TOKENS = ("<|endoftext|>",)
TOKENIZER_JSON_FILE = "tokenizer.json"
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
    """A byte-level BPE tokenizer (GPT-2, Radford et al. 2019), in-graph.

    Reads GPT-2's `vocab.json` and `merges.txt`, or a Hugging Face
    `tokenizer.json` whose model is byte-level BPE (GPT-J, GPT-Neo, GPT-NeoX,
    Llama 3, Qwen2; `from_tokenizer_json`). Added tokens are cut out of the
    text first and kept whole; the rest is split into words with the
    pre-tokenizer's regular expression, each word's UTF-8 bytes are mapped to
    printable characters, then adjacent symbols are merged in the order of
    the merges. Every step is a TensorFlow op (tensorflow-text's RE2
    `regex_split`, hash tables, a `tf.while_loop` for the merges), so the
    tokenizer can be saved inside a SavedModel; the ids equal the Hugging
    Face tokenizer's.

    Args:
        vocabulary: dict[str, int]. Token string to id, as in `vocab.json`.
        merges: list. Merge rules, highest priority first: `"left right"`
            strings as in `merges.txt` (without its `#version` line) or
            `[left, right]` pairs as newer `tokenizer.json` files hold them.
        special_tokens: dict[str, int] or None. Added tokens, found in the
            text and kept whole, to their ids (which may lie past the
            vocabulary). None: GPT-2's `<|endoftext|>` if the vocabulary has it.
        split_pattern: str. The pre-tokenizer's regular expression, one of
            `GPT2_SPLIT_PATTERN`, `LLAMA3_SPLIT_PATTERN`, `QWEN2_SPLIT_PATTERN`.
        normalization: None or "NFC". Unicode normalization of the text first.
        ignore_merges: bool. A word that is itself in the vocabulary is one
            token, without merging (Llama 3's tokenizer does this).
        prefix_ids: list[int]. Ids put before every text (Llama 3's
            `<|begin_of_text|>`, from the post-processor's template).
        suffix_ids: list[int]. Ids put after every text.
        eos_token: str or None. The end-of-text token, which gives `eos_id`.
            None: `<|endoftext|>` if it is a special token.
        tokenizer_json: str or None. The `tokenizer.json` text this was read
            from, written back by `save`.

    Example:
    >>> tokenizer = BytePairTokenizer.from_directory("gpt2")  # doctest: +SKIP
    >>> tokenizer.encode("Hello world")  # doctest: +SKIP
    [15496, 995]
    """

    def __init__(
        self,
        vocabulary,
        merges,
        special_tokens=None,
        split_pattern=GPT2_SPLIT_PATTERN,
        normalization=None,
        ignore_merges=False,
        prefix_ids=(),
        suffix_ids=(),
        eos_token=None,
        tokenizer_json=None,
        name=None,
    ):
        super().__init__(name=name)
        if not vocabulary:
            raise ValueError("`vocabulary` is empty. Received: vocabulary={}")
        if split_pattern not in _SPLIT_PATTERNS:
            raise ValueError(
                "`split_pattern` is not a pre-tokenizer pattern tfgpt runs in RE2 (which "
                "has no lookahead); it runs GPT-2's, Llama 3's and Qwen2's. "
                f"Received: split_pattern={split_pattern!r}"
            )
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"`normalization` must be one of {NORMALIZATIONS}. "
                f"Received: normalization={normalization!r}"
            )
        self.vocabulary = dict(vocabulary)
        self.merges = [_merge_rule(merge, index) for index, merge in enumerate(merges)]
        if special_tokens is None:
            special_tokens = {
                token: self.vocabulary[token]
                for token in _SPECIAL_TOKENS
                if token in self.vocabulary
            }
        self.special_tokens = dict(special_tokens)
        self.split_pattern = split_pattern
        self.normalization = normalization
        self.ignore_merges = bool(ignore_merges)
        self.prefix_ids = [int(i) for i in prefix_ids]
        self.suffix_ids = [int(i) for i in suffix_ids]
        self.tokenizer_json = tokenizer_json
        ids = list(self.vocabulary.values())
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(
                "`vocabulary` ids must be distinct and non-negative. Received "
                f"{len(ids)} tokens with {len(set(ids))} distinct ids, "
                f"smallest {min(ids)}"
            )
        all_ids = ids + list(self.special_tokens.values())
        if min(all_ids) < 0:
            raise ValueError(
                "`special_tokens` ids must be non-negative. "
                f"Received: special_tokens={self.special_tokens}"
            )
        self.vocabulary_size = max(all_ids) + 1
        for index in self.prefix_ids + self.suffix_ids:
            if not 0 <= index < self.vocabulary_size:
                raise ValueError(
                    f"`prefix_ids` and `suffix_ids` must be in [0, {self.vocabulary_size}). "
                    f"Received: prefix_ids={self.prefix_ids}, suffix_ids={self.suffix_ids}"
                )
        byte_map = bytes_to_unicode()
        missing = [c for c in byte_map.values() if c not in self.vocabulary]
        if missing:
            raise ValueError(
                "`vocabulary` is not a byte-level BPE vocabulary: it lacks "
                f"{len(missing)} of the 256 byte symbols, e.g. {missing[:3]!r}"
            )
        if eos_token is None and "<|endoftext|>" in self.special_tokens:
            eos_token = "<|endoftext|>"
        if eos_token is not None and eos_token not in self.special_tokens:
            if eos_token not in self.vocabulary:
                raise ValueError(
                    "`eos_token` must be a special token or in the vocabulary. "
                    f"Received: eos_token={eos_token!r}"
                )
        # The first id the post-processor puts before the text (Llama 3's).
        self.bos_id = self.prefix_ids[0] if self.prefix_ids else None
        self.eos_id = None
        if eos_token is not None:
            self.eos_id = self.special_tokens.get(eos_token, self.vocabulary.get(eos_token))

        # A special token is looked up by its byte symbols, like any word,
        # and written back from them.
        token_to_id = dict(self.vocabulary)
        for token, index in self.special_tokens.items():
            token_to_id[_to_symbols(token, byte_map)] = index
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
        self._token_to_id = _static_table(list(token_to_id), list(token_to_id.values()), -1)
        id_to_token = [""] * self.vocabulary_size
        for token, index in token_to_id.items():
            id_to_token[index] = token
        self._id_to_token = tf.constant(id_to_token)
        self._special = tf.constant(list(self.special_tokens) or [""], tf.string)
        pattern = _SPLIT_PATTERNS[split_pattern]
        self._gap_pattern = f"[{pattern.gap}]+"
        if self.special_tokens:
            # Longest first: RE2 takes the first alternative that matches,
            # Hugging Face's added-token matcher the longest.
            ordered = sorted(self.special_tokens, key=len, reverse=True)
            self._special_pattern = "|".join(_re2_escape(token) for token in ordered)
            self._word_pattern = f"{self._special_pattern}|{pattern.words}"
        else:
            self._special_pattern = None
            self._word_pattern = pattern.words

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
    def from_tokenizer_json(cls, path, eos_token=None):
        """Builds the tokenizer from a Hugging Face `tokenizer.json` (byte-level BPE).

        Args:
            path: str. The `tokenizer.json` file.
            eos_token: str or None. The end-of-text token; None reads
                `eos_token` from `tokenizer_config.json` beside it, else
                `<|endoftext|>`.
        """
        return cls(**read_tokenizer_json(path, eos_token))

    @classmethod
    def from_directory(cls, directory):
        """Builds the tokenizer from `directory`: its `tokenizer.json` if it has one,
        else its `vocab.json` and `merges.txt`.
        """
        if os.path.isfile(os.path.join(directory, TOKENIZER_JSON_FILE)):
            return cls.from_tokenizer_json(os.path.join(directory, TOKENIZER_JSON_FILE))
        return cls.from_files(
            os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
        )

    def save(self, directory):
        """Writes `vocab.json` and `merges.txt` to `directory`, and the
        `tokenizer.json` it was read from, if any."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as file:
            json.dump(self.vocabulary, file, ensure_ascii=False)
        with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as file:
            file.write("#version: 0.2\n" + "\n".join(self.merges) + "\n")
        if self.tokenizer_json is not None:
            path = os.path.join(directory, TOKENIZER_JSON_FILE)
            with open(path, "w", encoding="utf-8") as file:
                file.write(self.tokenizer_json)

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
        if self.normalization is not None:
            texts = tf_text.normalize_utf8(texts, self.normalization)
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
        words = _split_trailing_whitespace(words, self._gap_pattern, self._is_special)
        words = pieces.with_flat_values(words).merge_dims(1, 2)  # (B, words)

        unique_words, word_index = tf.unique(words.flat_values)  # (U,), (N,)
        symbols = self._initial_symbols(unique_words)  # (U, S)
        symbols = self._merge(symbols)  # (U, S)
        symbols = tf.ragged.boolean_mask(symbols, symbols != "")  # (U, None)
        ids = self._token_to_id.lookup(symbols)  # (U, None)
        tf.debugging.assert_non_negative(
            ids.flat_values,
            message="A merged symbol is missing from the vocabulary: "
            "the vocabulary and the merges do not belong together",
        )
        ids = tf.gather(ids, word_index)  # (N, None)
        ids = tf.cast(words.with_flat_values(ids).merge_dims(1, 2), tf.int32)  # (B, None)
        batch = tf.shape(texts)[0:1]
        if self.prefix_ids:
            prefix = tf.tile(tf.constant([self.prefix_ids], tf.int32), tf.concat([batch, [1]], 0))
            ids = tf.concat([tf.RaggedTensor.from_tensor(prefix), ids], axis=1)
        if self.suffix_ids:
            suffix = tf.tile(tf.constant([self.suffix_ids], tf.int32), tf.concat([batch, [1]], 0))
            ids = tf.concat([ids, tf.RaggedTensor.from_tensor(suffix)], axis=1)
        return ids

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
        # Special tokens are stored as byte symbols too (`__init__`).
        token_bytes = tf.strings.reduce_join(byte_strings, axis=-1)  # (N,)
        text = tf.strings.reduce_join(tokens.with_flat_values(token_bytes), axis=-1)
        return tf.strings.unicode_transcode(
            text, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD
        )

    # ---- helpers -----------------------------------------------------------

    def _is_special(self, words):
        """Whether each of `words` (N,) is a special token: (N,) bool."""
        return tf.reduce_any(words[:, tf.newaxis] == self._special[tf.newaxis, :], axis=1)

    def _initial_symbols(self, words):
        """Maps each word's bytes to symbols: (U,) -> dense (U, S), "" padded."""
        byte_symbols = self._byte_to_symbol.lookup(tf.strings.bytes_split(words))
        dense = byte_symbols.to_tensor("")  # (U, S')
        dense = tf.pad(dense, [[0, 0], [0, 1]], constant_values="")  # S >= 1
        # A special token is one symbol; with `ignore_merges`, so is a word
        # in the vocabulary.
        whole = tf.strings.reduce_join(dense, axis=1)  # (U,)
        is_whole = self._is_special(words)  # (U,)
        if self.ignore_merges:
            is_whole |= self._token_to_id.lookup(whole) >= 0
        first = tf.where(is_whole, whole, dense[:, 0])  # (U,)
        rest = tf.where(is_whole[:, tf.newaxis], "", dense[:, 1:])  # (U, S-1)
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


def _to_symbols(text, byte_map):
    """The byte symbols of `text`: its UTF-8 bytes through `bytes_to_unicode`."""
    return "".join(byte_map[byte] for byte in text.encode("utf-8"))


def _merge_rule(merge, index):
    """`"left right"` from a merges.txt line or a tokenizer.json pair."""
    if isinstance(merge, str):
        parts = merge.split()
    elif isinstance(merge, (list, tuple)) and all(isinstance(p, str) for p in merge):
        parts = list(merge)
    else:
        parts = None
    # Byte-level symbols never hold whitespace, so a space joins the two.
    if parts is None or len(parts) != 2 or any(not p or p != "".join(p.split()) for p in parts):
        raise ValueError(
            "Each merge must be two symbols separated by a space, or a pair of "
            f"two symbols. Received: merges[{index}]={merge!r}"
        )
    return " ".join(parts)


def _split_trailing_whitespace(words, gap, is_special):
    """Cuts the whitespace runs between matches as `\\s+(?!\\S)|\\s+` would.

    `words` (P, None) come from a `regex_split` that leaves whitespace as the
    text between matches: a gap, made only of characters of `gap` (a run
    `[...]+`). At a gap's first character no alternative of the pattern
    matched, nor at any of its characters but perhaps the last (which may
    start the next word: GPT-2's ` ?\\p{L}+`, Llama 3's
    `[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`). So where the reference tries
    `\\s+(?!\\S)` the run reaches the next word or the end of the piece:

    - at the end of a piece the whole run matches: one token;
    - when the next word starts with whitespace, that was the run's last
      character, and the gap is what `\\s+(?!\\S)` leaves: one token;
    - otherwise `\\s+(?!\\S)` takes all but the last character and `\\s+`
      the last alone: two tokens (one for a run of one character).

    `is_special(words)` marks the special tokens, never cut.
    """
    flat = words.flat_values  # (N,)
    count = tf.shape(flat, out_type=tf.int64)[0]
    is_last = tf.scatter_nd(
        (words.row_limits() - 1)[words.row_lengths() > 0][:, tf.newaxis],
        tf.ones_like(words.row_limits()[words.row_lengths() > 0], tf.bool),
        [count],
    )  # (N,)
    is_gap = tf.strings.regex_full_match(flat, gap) & ~is_special(flat)
    length = tf.strings.length(flat, unit="UTF8_CHAR")
    head = tf.strings.substr(flat, tf.zeros_like(length), length - 1, unit="UTF8_CHAR")
    tail = tf.strings.substr(flat, length - 1, tf.ones_like(length), unit="UTF8_CHAR")
    following = tf.concat([flat[1:], [""]], axis=0)  # (N,)
    next_first = tf.strings.substr(following, 0, 1, unit="UTF8_CHAR")
    joined_next = tf.strings.regex_full_match(next_first, f"[{_WHITESPACE}]")
    split = is_gap & ~is_last & (length > 1) & ~joined_next  # (N,)
    parts = tf.stack([tf.where(split, head, flat), tf.where(split, tail, "")], axis=1)
    parts = tf.ragged.boolean_mask(parts, parts != "")  # (N, 1 or 2)
    return words.with_flat_values(parts).merge_dims(1, 2)
