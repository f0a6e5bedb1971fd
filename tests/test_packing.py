"""Packed instruction examples: `prepare --pack` and the reader's segment ids.

The oracle: the tokenizer's own ids and learned flags of each example,
every example in exactly one packed record.
"""

import collections

import numpy as np
import pytest

from pipelines import prepare
from pipelines.instruction_data import make_instruction_dataset
from pipelines.prepare.shard_writer import best_fit
from pipelines.reader import load_manifest
from pipelines.tokenizer import Tokenizer
from tests.test_instruction_data import _examples, _prepare

RECORD = 17  # --seq-len 16 + 1

# ---- Best fit --------------------------------------------------------------------------------


def test_best_fit_puts_each_item_in_the_fullest_bin_it_fits():
    # Longest first: 6 -> a new bin (room 2), 5 -> new (3), 4 -> new (4), 3 -> the bin with
    # room 3, 2 -> the bin with room 2, 1 -> the only one with room (4).
    assert best_fit([5, 3, 4, 2, 6, 1], 8) == [[4, 3], [0, 1], [2, 5]]
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, RECORD + 1, int(rng.integers(1, 80))).tolist()
        bins = best_fit(lengths, RECORD)
        assert sorted(index for numbers in bins for index in numbers) == list(range(len(lengths)))
        assert max(sum(lengths[index] for index in numbers) for numbers in bins) <= RECORD
        fewest = -(-sum(lengths) // RECORD)  # a lower bound on the bins needed
        assert len(bins) <= 11 / 9 * fewest + 1  # Johnson's bound for best fit decreasing


# ---- prepare --pack and the reader -----------------------------------------------------------


def _expected_examples(tiny_data, examples):
    """`Counter` of (ids, learned) of the examples that fit a record, by the
    tokenizer; the EOS id; how many do not fit."""
    tokenizer = Tokenizer.load(str(tiny_data / "tokenizer.model"))
    expected, too_long = collections.Counter(), 0
    for example in examples:
        prompt = tokenizer.encode(example.get("prompt", ""))
        completion = tokenizer.encode(example.get("completion", example.get("text")))
        ids = (*prompt, *completion, tokenizer.eos_id)
        if len(ids) > RECORD:
            too_long += 1
            continue
        expected[ids, (0,) * len(prompt) + (1,) * (len(completion) + 1)] += 1
    return expected, tokenizer.eos_id, too_long


def test_pack_puts_every_example_in_one_record_with_its_ids_and_learned_flags(tmp_path,
                                                                             tiny_data):
    examples = _examples(60) + [{"prompt": "the cat", "completion": "sat " * 20}]  # too long
    code, out = _prepare(tmp_path, tiny_data, examples, "--pack")
    assert code == 0
    expected, eos_id, too_long = _expected_examples(tiny_data, examples)
    manifest = load_manifest(str(out))
    assert manifest["packed"] is True and manifest["format_version"] == 3
    seen, rows = collections.Counter(), 0
    for split in ("train", "val"):
        dataset = make_instruction_dataset(str(out), split, 1, shuffle=False, repeat=False)
        split_rows, filled = 0, 0
        for batch in dataset:
            inputs, targets, weights, segment_ids = (part.numpy()[0] for part in batch)
            assert inputs.shape == targets.shape == weights.shape == segment_ids.shape == (16,)
            tokens = np.r_[inputs[:1], targets]  # (17,): the record's tokens
            count = int(segment_ids.max())
            assert count >= 1
            for segment in range(1, count + 1):
                where = np.flatnonzero(segment_ids == segment)
                start = int(where[0])
                end = start + int(np.flatnonzero(tokens[start:] == eos_id)[0])  # its EOS
                np.testing.assert_array_equal(where, np.arange(start, min(end + 1, 16)))
                ids = tuple(tokens[start:end + 1].tolist())
                learned = tuple(weights[start:end].astype(int).tolist())
                key = next(k for k in expected if k[0] == ids)
                assert learned == key[1][1:], (ids, learned)  # its first token: no one's target
                seen[key] += 1
                filled += end + 1 - start
                if end < 16:
                    assert weights[end] == 0  # the next example's first token, or padding
            assert not weights[segment_ids == 0].any()
            used = int(np.count_nonzero(segment_ids))
            assert not segment_ids[used:].any()  # the examples, then the padding
            split_rows += 1
        summary = manifest["splits"][split]
        assert summary["sequences"] == split_rows
        assert summary["fill"] == pytest.approx(filled / (split_rows * RECORD), abs=1e-6)
        rows += split_rows
    assert seen == expected
    assert rows < sum(expected.values())  # several examples to a record
    assert sum(manifest["splits"][split]["dropped_examples"] for split in ("train", "val")) == (
        too_long)


def test_pack_needs_the_instruction_format(tmp_path, tiny_data, capsys):
    assert prepare.main(["--output", str(tmp_path / "a"), "--seq-len", "16", "--tokenizer",
                         str(tiny_data), "--pack"]) == 2
    assert "`pack` packs instruction examples: it needs --format instructions" in (
        capsys.readouterr().err)
