"""Reads a Hugging Face `tokenizer.json` holding a byte-level BPE tokenizer.

GPT-2, GPT-J, GPT-Neo, GPT-NeoX (Pythia), Llama 3 and Qwen2 ship one. What is
read, and what is accepted of each section (anything else is a ValueError
naming the file and the value, never a silently different tokenizer):

- `model`: type "BPE", its `vocab`, its `merges` ("a b" strings or
  ["a", "b"] pairs) and `ignore_merges`; no dropout, no unknown token, no
  subword prefix or suffix, no byte fallback.
- `added_tokens`: kept whole wherever they appear in the text, mapped to
  their ids; none may strip the spaces around it or match single words only.
- `normalizer`: none or NFC.
- `pre_tokenizer`: ByteLevel with its built-in GPT-2 pattern, or a Sequence
  of a Split on GPT-2's, Llama 3's or Qwen2's pattern (behavior "Isolated")
  and ByteLevel without its pattern; never a prefix space.
- `post_processor`: none, ByteLevel, or TemplateProcessing whose single
  template is special tokens around `$A` (Llama 3's `<|begin_of_text|>`), or
  a Sequence of those.
- `decoder`: ByteLevel.
"""

import json
import os

# The pre-tokenizer patterns tfgpt runs, as Hugging Face's tokenizer.json
# spells them (Oniguruma syntax); `tfgpt.tokenizers.byte_pair_tokenizer`
# runs each in RE2.
GPT2_SPLIT_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's is Llama 3's with single digits.
QWEN2_SPLIT_PATTERN = LLAMA3_SPLIT_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
SPLIT_PATTERNS = (GPT2_SPLIT_PATTERN, LLAMA3_SPLIT_PATTERN, QWEN2_SPLIT_PATTERN)

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def read_tokenizer_json(path, eos_token=None):
    """The `BytePairTokenizer` arguments of the `tokenizer.json` at `path`.

    Args:
        path: str. The `tokenizer.json` file.
        eos_token: str or None. The end-of-text token; None takes the one the
            files beside `path` name (`configured_eos`).

    Returns:
        dict of keyword arguments for `BytePairTokenizer`.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Tokenizer file not found: {path}")
    with open(path, encoding="utf-8") as file:
        text = file.read()
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    model = content.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(
            f"{path}: tfgpt reads byte-level BPE tokenizers, and this model is not BPE. "
            f"Received: model type={model.get('type')!r}"
        )
    for key, accepted in (("dropout", (None, 0.0)), ("unk_token", (None,)),
                          ("continuing_subword_prefix", (None, "")),
                          ("end_of_word_suffix", (None, "")), ("byte_fallback", (None, False))):
        if model.get(key) not in accepted:
            raise ValueError(
                f"{path}: tfgpt's byte-level BPE has no {key}. Received: model "
                f"{key}={model.get(key)!r}"
            )
    _check_decoder(content.get("decoder"), path)
    vocabulary = model.get("vocab") or {}
    special_tokens = _added_tokens(content.get("added_tokens") or [], path)
    if eos_token is None:
        pieces = {index: token for token, index in {**vocabulary, **special_tokens}.items()}
        eos_token = configured_eos(os.path.dirname(path), pieces)
    return dict(
        vocabulary=vocabulary,
        merges=model.get("merges") or [],
        special_tokens=special_tokens,
        split_pattern=_split_pattern(content.get("pre_tokenizer"), path),
        normalization=_normalization(content.get("normalizer"), path),
        ignore_merges=bool(model.get("ignore_merges", False)),
        **_template(content.get("post_processor"), path),
        eos_token=eos_token,
        tokenizer_json=text,
    )


def _added_tokens(added_tokens, path):
    special_tokens = {}
    for token in added_tokens:
        for key in ("single_word", "lstrip", "rstrip"):
            if token.get(key):
                raise ValueError(
                    f"{path}: tfgpt keeps added tokens whole and matches them anywhere; "
                    f"this one has {key} set. Received: added token {token.get('content')!r}"
                )
        special_tokens[token["content"]] = int(token["id"])
    return special_tokens


def _split_pattern(pre_tokenizer, path):
    """The regular expression of a byte-level pre-tokenizer."""
    steps = [pre_tokenizer] if pre_tokenizer else []
    if steps and steps[0].get("type") == "Sequence":
        steps = steps[0].get("pretokenizers") or []
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        pattern = GPT2_SPLIT_PATTERN
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split = steps[0]
        if split.get("behavior") != "Isolated" or split.get("invert"):
            raise ValueError(
                f"{path}: the Split pre-tokenizer must keep its matches as words "
                "(behavior Isolated, invert false). Received: "
                f"behavior={split.get('behavior')!r}, invert={split.get('invert')!r}"
            )
        pattern = (split.get("pattern") or {}).get("Regex")
        if pattern not in SPLIT_PATTERNS:
            raise ValueError(
                f"{path}: tfgpt runs the pre-tokenizer pattern in RE2, which has no "
                "lookahead, and supports GPT-2's, Llama 3's and Qwen2's. Received: "
                f"pattern={split.get('pattern')!r}"
            )
    else:
        raise ValueError(
            f"{path}: the pre-tokenizer must be byte-level: ByteLevel, or Split then "
            f"ByteLevel(use_regex=false). Received: pre_tokenizer types={kinds}"
        )
    if steps[-1].get("add_prefix_space"):
        raise ValueError(
            f"{path}: tfgpt does not add a prefix space. Received: ByteLevel "
            "add_prefix_space=true"
        )
    return pattern


def _normalization(normalizer, path):
    if normalizer is None:
        return None
    if normalizer.get("type") == "NFC":
        return "NFC"
    raise ValueError(
        f"{path}: the only normalizer tfgpt applies is NFC. Received: "
        f"normalizer type={normalizer.get('type')!r}"
    )


def _template(post_processor, path):
    """`prefix_ids` and `suffix_ids` from the post-processor's single template."""
    steps = [post_processor] if post_processor else []
    if steps and steps[0].get("type") == "Sequence":
        steps = steps[0].get("processors") or []
    ids = {"prefix_ids": [], "suffix_ids": []}
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            continue  # Offsets only.
        if kind != "TemplateProcessing":
            raise ValueError(
                f"{path}: the post-processor must be ByteLevel or TemplateProcessing. "
                f"Received: post_processor type={kind!r}"
            )
        side = "prefix_ids"
        for piece in step.get("single") or []:
            if "Sequence" in piece:
                side = "suffix_ids"
            else:
                name = piece["SpecialToken"]["id"]
                ids[side] += step["special_tokens"][name]["ids"]
    return ids


def _check_decoder(decoder, path):
    if (decoder or {}).get("type") != "ByteLevel":
        raise ValueError(
            f"{path}: the decoder must be ByteLevel. Received: decoder "
            f"type={(decoder or {}).get('type')!r}"
        )


def configured_eos(directory, pieces):
    """The end-of-text token the files of `directory` name, or None.

    In order: `eos_token` of `tokenizer_config.json`; the token of
    `eos_token_id` in `config.json` (a transformers checkpoint's, the first
    of a list; a tfgpt run started from one records it too); `eos_piece` of
    a data directory's `manifest.json` (`pipelines.prepare`).

    Args:
        directory: str.
        pieces: dict of int -> str. The tokenizer's ids to their tokens.
    """
    def read(name):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as file:
            content = json.load(file)
        return content if isinstance(content, dict) else {}

    eos_token = read(TOKENIZER_CONFIG_FILE).get("eos_token")
    if isinstance(eos_token, dict):  # An AddedToken written out.
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str):
        return eos_token
    eos_id = read("config.json").get("eos_token_id")
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    if isinstance(eos_id, int) and eos_id in pieces:
        return pieces[eos_id]
    eos_piece = (read("manifest.json").get("tokenizer") or {}).get("eos_piece")
    return eos_piece if isinstance(eos_piece, str) else None
