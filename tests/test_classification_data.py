"""Classification data: GLUE SST-2 TSV and JSON Lines readers, label checks, encoding."""

import json

import numpy as np
import pytest

from tfgpt.finetuning.classification import (
    encode_classification,
    read_classification_file,
)


class CharacterTokenizer:
    """One id per character (test stand-in): `ord(c) % 50 + 3`."""

    pad_id, cls_id, sep_id = 0, 1, 2

    def encode(self, text):
        return [ord(character) % 50 + 3 for character in text]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


SST2 = (
    "sentence\tlabel\n"
    "it 's a charming and often affecting journey . \t1\n"
    'unflinchingly bleak and "desperate" \t0\n'
    "\n"
    "allows us to hope that nolan is poised to embark a major career \t1\n"
)


def test_reads_glue_sst2_tsv(tmp_path):
    texts, label_ids = read_classification_file(write(tmp_path, "dev.tsv", SST2), labels=["0", "1"])
    assert texts[1] == 'unflinchingly bleak and "desperate" '  # quotes kept, no CSV quoting
    assert len(texts) == 3
    assert label_ids.dtype == np.int32
    np.testing.assert_array_equal(label_ids, [1, 0, 1])


def test_label_ids_follow_the_declared_order(tmp_path):
    _, label_ids = read_classification_file(write(tmp_path, "dev.tsv", SST2), labels=["1", "0"])
    np.testing.assert_array_equal(label_ids, [0, 1, 0])


def test_reads_tsv_with_extra_columns(tmp_path):
    path = write(tmp_path, "x.tsv", "id\ttext\tlabel\n7\tgood\tpos\n8\tbad\tneg\n")
    texts, label_ids = read_classification_file(path, labels=["neg", "pos"])
    assert texts == ["good", "bad"]
    np.testing.assert_array_equal(label_ids, [1, 0])


def test_reads_json_lines_with_string_and_integer_labels(tmp_path):
    lines = [
        json.dumps({"text": "great film", "label": 1}),
        json.dumps({"text": "dull", "label": "0", "id": 5}),
        "",
        json.dumps({"text": "neutral-ish", "label": 2}),
    ]
    path = write(tmp_path, "train.jsonl", "\n".join(lines) + "\n")
    texts, label_ids = read_classification_file(path, labels=[0, 1, 2])
    assert texts == ["great film", "dull", "neutral-ish"]
    np.testing.assert_array_equal(label_ids, [1, 0, 2])


BAD_FILES = {
    "tsv-label": (
        "a.tsv",
        "sentence\tlabel\ngood\t1\nbad\t2\n",
        r"a\.tsv:3: label '2' is not one of the declared labels \['0', '1'\]",
    ),
    "jsonl-label": (
        "b.jsonl",
        '{"text": "ok", "label": 0}\n{"text": "x", "label": "positive"}\n',
        r"b\.jsonl:2: label 'positive'",
    ),
    "fields": (
        "c.tsv",
        "sentence\tlabel\ngood\t1\nno tab here\n",
        r"c\.tsv:3: expected 2 tab-separated fields.*found 1",
    ),
    "header": ("d.tsv", "sentence\tscore\ngood\t1\n", r"d\.tsv:1: the header must name.*'score'"),
    "json": (
        "e.jsonl",
        '{"text": "ok", "label": 0}\n{"text": "ok", "label": 0\n',
        r"e\.jsonl:2: malformed JSON",
    ),
    "keys": (
        "f.jsonl",
        '{"sentence": "ok", "label": 0}\n',
        r"f\.jsonl:1: .*\"text\" and \"label\"",
    ),
    "float-label": (
        "g.jsonl",
        '{"text": "ok", "label": 1.0}\n',
        r"g\.jsonl:1: \"label\" must be a string or an integer. Received: 1\.0",
    ),
    "bool-label": ("h.jsonl", '{"text": "ok", "label": true}\n', r"h\.jsonl:1: \"label\".*True"),
    "empty": ("i.tsv", "sentence\tlabel\n", r"i\.tsv: no records"),
    "extension": ("j.csv", "sentence,label\n", r"expected \.tsv, \.jsonl or \.json.*j\.csv"),
}


@pytest.mark.parametrize("name, content, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_files_raise_naming_line_and_value(tmp_path, name, content, message):
    with pytest.raises(ValueError, match=message):
        read_classification_file(write(tmp_path, name, content), labels=["0", "1"])


def test_declared_labels_must_be_distinct(tmp_path):
    with pytest.raises(ValueError, match=r"labels=\['1', 1\]"):
        read_classification_file(write(tmp_path, "dev.tsv", SST2), labels=["1", 1])
    with pytest.raises(ValueError, match=r"Cannot read .*missing\.tsv"):
        read_classification_file(str(tmp_path / "missing.tsv"), labels=["0", "1"])


def test_encode_adds_cls_and_sep_truncates_and_pads():
    tokenizer = CharacterTokenizer()
    inputs = encode_classification(["ab", "abcdefgh"], tokenizer, max_sequence_length=6)
    a, b, c, d = (tokenizer.encode(ch)[0] for ch in "abcd")
    np.testing.assert_array_equal(inputs["token_ids"], [[1, a, b, 2, 0, 0], [1, a, b, c, d, 2]])
    np.testing.assert_array_equal(inputs["padding_mask"], [[1, 1, 1, 1, 0, 0], [1] * 6])
    np.testing.assert_array_equal(inputs["segment_ids"], np.zeros((2, 6)))
    assert all(array.dtype == np.int32 for array in inputs.values())
    with pytest.raises(ValueError, match=r"max_sequence_length=2"):
        encode_classification(["ab"], tokenizer, max_sequence_length=2)
