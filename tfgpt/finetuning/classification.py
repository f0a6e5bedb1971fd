"""Sequence classification data: GLUE-style TSV and JSON Lines readers, encoding.

Two layouts, chosen by the file's extension:

- `.tsv`: a header line naming the columns, then one record per line, fields
  separated by tabs and never quoted (GLUE's SST-2 `train.tsv` and
  `dev.tsv`: `sentence<TAB>label`). The text column is `sentence` (or
  `text`); the label column is `label`.
- `.jsonl` / `.json`: one JSON object per line with `text` and `label`.

Labels are checked against the set the caller declares, so a typo or a
label from another task fails on its line instead of becoming a new class.

Example:
>>> texts, label_ids = read_classification_file(
...     "SST-2/dev.tsv", labels=["0", "1"])  # doctest: +SKIP
>>> inputs = encode_classification(texts, tokenizer, max_sequence_length=128)  # doctest: +SKIP
"""

import json
import os

import numpy as np

TEXT_COLUMNS = ("sentence", "text")


def read_classification_file(path, labels):
    """Reads texts and labels from a GLUE-style TSV or a JSON Lines file.

    Args:
        path: str. A `.tsv`, `.jsonl` or `.json` (JSON Lines) file.
        labels: sequence of str (or int). The declared label set; label i of
            the sequence gets class id i. Integer labels in JSON compare by
            their decimal text (`1` matches `"1"`).

    Returns:
        `(texts, label_ids)`: a list of str and an int32 array.

    Raises:
        ValueError: naming the file and line for a label outside `labels`,
            a missing column or key, a wrong number of TSV fields or
            malformed JSON; and for a file without records.
    """
    names = [str(label) for label in labels]
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(
            f"`labels` must declare at least two distinct labels. Received: labels={list(labels)!r}"
        )
    label_ids = {name: index for index, name in enumerate(names)}
    texts, ids = [], []
    for line_number, text, label in read_records(path):
        if label not in label_ids:
            raise ValueError(
                f"{path}:{line_number}: label {label!r} is not one of the declared "
                f"labels {names}"
            )
        texts.append(text)
        ids.append(label_ids[label])
    if not texts:
        raise ValueError(f"{path}: no records")
    return texts, np.asarray(ids, np.int32)


def read_records(path):
    """`(line_number, text, label)` of each record, in the layout the extension names.

    Labels are as the file spells them (str, or a JSON int's decimal text);
    a malformed line raises `ValueError` naming it when it is reached.
    """
    extension = os.path.splitext(path)[1].lower()
    if extension == ".tsv":
        return _read_tsv(path)
    if extension in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise ValueError(
        f"Unknown classification file type (expected .tsv, .jsonl or .json). Received: {path}"
    )


def _open_lines(path):
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().splitlines()
    except OSError as error:
        raise ValueError(f"Cannot read {path} ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error})") from None


def _read_tsv(path):
    lines = _open_lines(path)
    if not lines:
        raise ValueError(f"{path}: empty file (expected a header line such as 'sentence\\tlabel')")
    header = lines[0].split("\t")
    text_column = next((name for name in TEXT_COLUMNS if name in header), None)
    if text_column is None or "label" not in header:
        raise ValueError(
            f"{path}:1: the header must name a text column ({' or '.join(TEXT_COLUMNS)}) "
            f"and a label column (label). Received header: {header}"
        )
    text_index, label_index = header.index(text_column), header.index("label")
    for line_number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            raise ValueError(
                f"{path}:{line_number}: expected {len(header)} tab-separated fields "
                f"({', '.join(header)}), found {len(fields)}"
            )
        yield line_number, fields[text_index], fields[label_index]


def _read_jsonl(path):
    for line_number, line in enumerate(_open_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_number}: malformed JSON line ({error})") from None
        if not isinstance(record, dict) or "text" not in record or "label" not in record:
            raise ValueError(
                f"{path}:{line_number}: each line must be an object with \"text\" and \"label\""
            )
        text, label = record["text"], record["label"]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{line_number}: \"text\" must be a string. Received: {text!r}")
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise ValueError(
                f"{path}:{line_number}: \"label\" must be a string or an integer. "
                f"Received: {label!r}"
            )
        yield line_number, text, str(label)


def encode_classification(texts, tokenizer, max_sequence_length):
    """Encodes texts as `[CLS] text [SEP]`, cut and padded to `max_sequence_length`.

    Args:
        texts: sequence of str.
        tokenizer: an object with `encode(text)` -> ids and integer
            `cls_id`, `sep_id`, `pad_id` attributes.
        max_sequence_length: int. At least 3.

    Returns:
        dict of int32 arrays (N, T): `token_ids`, `segment_ids` (all 0) and
        `padding_mask`, the inputs of `SequenceClassifier`.
    """
    if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or (
        max_sequence_length < 3
    ):
        raise ValueError(
            "`max_sequence_length` must be an integer >= 3. "
            f"Received: max_sequence_length={max_sequence_length!r}"
        )
    token_ids = np.full((len(texts), max_sequence_length), tokenizer.pad_id, np.int32)
    padding_mask = np.zeros((len(texts), max_sequence_length), np.int32)
    for row, text in enumerate(texts):
        ids = list(tokenizer.encode(text))[: max_sequence_length - 2]
        ids = [tokenizer.cls_id, *ids, tokenizer.sep_id]
        token_ids[row, : len(ids)] = ids
        padding_mask[row, : len(ids)] = 1
    return {
        "token_ids": token_ids,
        "segment_ids": np.zeros_like(token_ids),
        "padding_mask": padding_mask,
    }
