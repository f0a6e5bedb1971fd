"""Packed instruction examples: `prepare --pack`, the reader's segment ids, and the model.

The oracles: the tokenizer's own ids and learned flags of each example
(every example in exactly one packed record), and the same examples
unpacked, one to a padded row: the same loss, the same gradients, and
each example's logits as if it were alone.
"""

import collections
import contextlib

import numpy as np
import pytest
import tensorflow as tf

from pipelines import prepare
from pipelines.instruction_data import make_instruction_dataset
from pipelines.prepare.shard_writer import best_fit
from pipelines.reader import load_manifest
from pipelines.tokenizer import Tokenizer
from tests.kernel_checks import traced_op_types
from tests.test_instruction_data import _examples, _prepare
from tfgpt import kernels
from tfgpt.models.gpt import GPT
from tfgpt.training.objectives import InstructionTuning
from tfgpt.training.train_step import cross_entropy

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


# ---- The model: packed rows compute each example as if it were alone ------------------------

# Three examples (ids, learned), 17 tokens in all with their EOS (id 1): one packed record.
EXAMPLES = [
    ([5, 9, 13, 2, 1], [0, 0, 1, 1, 1]),
    ([7, 3, 3, 8, 40, 21, 1], [0, 1, 1, 1, 1, 1, 1]),
    ([11, 6, 30, 17, 1], [0, 0, 0, 1, 1]),
]


def _rows(records):
    """`(inputs, targets, weights, segment_ids)` of records of (ids, learned,
    segments), padded to 17 tokens as `make_instruction_dataset` pads them."""
    ids, learned, segments = (np.array([np.pad(r[i], (0, RECORD - len(r[i]))) for r in records])
                              for i in range(3))
    weights = learned[:, 1:] * (segments[:, 1:] == segments[:, :-1])
    return (tf.constant(ids[:, :-1], tf.int32), tf.constant(ids[:, 1:], tf.int32),
            tf.constant(weights, tf.float32), tf.constant(segments[:, :-1], tf.int32))


def _packed_and_unpacked():
    packed = [tuple(sum((list(part[i]) if i < 2 else [n + 1] * len(part[0])
                         for n, part in enumerate(EXAMPLES)), []) for i in range(3))]
    alone = [(ids, learned, [1] * len(ids)) for ids, learned in EXAMPLES]
    return _rows(packed), _rows(alone)[:3]


MODELS = {
    "learned positions": {},
    "rotary, grouped, rms, gated": dict(positions="rotary", num_key_value_heads=1, norm="rms",
                                        feedforward="gated", activation="silu"),
    "sliding window": dict(sliding_window=4, window_layers="all"),
}
# The fused kernels each model's packed rows take, forward and backward: the
# whole attention core, the softmax alone, or neither (a window's mask).
FUSED_OPS = {
    "learned positions": {"TfgptCausalAttention", "TfgptCausalAttentionGrad"},
    "rotary, grouped, rms, gated": {"TfgptCausalSoftmax", "TfgptCausalSoftmaxGrad"},
    "sliding window": set(),
}
ATTENTION_OPS = set().union(*FUSED_OPS.values())


def _model(**overrides):
    tf.keras.utils.set_random_seed(3)
    return GPT(vocabulary_size=50, max_sequence_length=16, num_layers=3, num_heads=2,
               hidden_dim=16, intermediate_dim=24, dropout=0.0, **overrides)


def _loss_and_gradients(model, batch):
    task = InstructionTuning()
    with tf.GradientTape() as tape:
        loss, _ = task.loss(model, batch, training=True)
    gradients = tape.gradient(loss, model.trainable_variables)
    return loss.numpy(), [tf.convert_to_tensor(g).numpy() for g in gradients]


def _attention_ops(model, batch):
    """The fused attention and softmax ops in a traced loss and gradient of `batch`."""
    task = InstructionTuning()

    def loss_and_gradients():
        with tf.GradientTape() as tape:
            loss, _ = task.loss(model, batch, training=True)
        return tape.gradient(loss, model.trainable_variables)

    return ATTENTION_OPS & traced_op_types(loss_and_gradients)


@pytest.mark.parametrize("fused", [True, False], ids=["fused kernels", "plain ops"])
@pytest.mark.parametrize("name", MODELS)
def test_packed_and_unpacked_examples_give_the_same_loss_and_gradients(name, fused):
    if fused and kernels.library() is None:
        pytest.skip(f"the fused kernels' library {kernels.unavailable_reason()}")
    with contextlib.nullcontext() if fused else kernels.disabled():
        _check_packed_and_unpacked(name, fused)


def _check_packed_and_unpacked(name, fused):
    model = _model(**MODELS[name])
    packed, unpacked = _packed_and_unpacked()
    # The packed rows take the same kernels as the unpacked ones.
    assert _attention_ops(model, packed) == (FUSED_OPS[name] if fused else set())
    assert _attention_ops(model, unpacked) == (FUSED_OPS[name] if fused else set())
    assert packed[0].shape == (1, 16) and unpacked[0].shape == (3, 16)
    np.testing.assert_array_equal(tf.reduce_sum(packed[2]), tf.reduce_sum(unpacked[2]))
    packed_loss, packed_gradients = _loss_and_gradients(model, packed)
    unpacked_loss, unpacked_gradients = _loss_and_gradients(model, unpacked)
    np.testing.assert_allclose(packed_loss, unpacked_loss, rtol=0, atol=1e-6)
    for mine, theirs in zip(packed_gradients, unpacked_gradients):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    # Each example's logits, as it gets them alone in a row.
    logits = model(packed[0], segment_ids=packed[3]).numpy()[0]
    alone = model(unpacked[0]).numpy()
    start = 0
    for row, (ids, _) in enumerate(EXAMPLES):
        length = min(len(ids), 16 - start)
        np.testing.assert_allclose(logits[start:start + length], alone[row, :length],
                                   rtol=0, atol=1e-5)
        start += length
    # Without the segments, the examples would see each other: the test can tell.
    assert np.abs(model(packed[0]).numpy()[0] - logits).max() > 1e-3


@pytest.mark.parametrize("xla", [False, True], ids=["graph", "xla"])
def test_a_train_step_on_packed_and_on_unpacked_examples_makes_the_same_update(xla):
    import keras

    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.train_step import TrainStep

    task = InstructionTuning()
    packed, unpacked = _packed_and_unpacked()
    results = []
    for batch in (packed, unpacked):
        model = _model()
        step = TrainStep(model, keras.optimizers.SGD(learning_rate=1.0), LocalDistribution(),
                         loss_fn=task.loss, xla=xla, token_weights=task.token_weights)
        loss = float(step(*batch)["loss"])
        results.append((loss, [variable.numpy() for variable in model.trainable_variables]))
    (packed_loss, packed_weights), (unpacked_loss, unpacked_weights) = results
    np.testing.assert_allclose(packed_loss, unpacked_loss, rtol=0, atol=1e-6)
    initial = [variable.numpy() for variable in _model().trainable_variables]
    for mine, theirs, before in zip(packed_weights, unpacked_weights, initial):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    assert max(np.abs(mine - before).max() for mine, before in zip(packed_weights, initial)) > 0.01


def test_weightless_tokens_get_exactly_zero_gradient_in_a_packed_batch():
    model = _model()
    inputs, targets, weights, segment_ids = _packed_and_unpacked()[0]
    with tf.GradientTape() as tape:
        logits = model(inputs, segment_ids=segment_ids, training=True)
        tape.watch(logits)
        loss = cross_entropy(targets, logits, weights)
    gradient = tape.gradient(loss, logits).numpy()  # (1, 16, V)
    unweighted = weights.numpy() == 0
    assert unweighted.any() and (~unweighted).any()
    assert np.all(gradient[unweighted] == 0.0)
    assert np.all(np.abs(gradient[~unweighted]).max(axis=-1) > 0)


def test_cached_decoding_of_a_packed_row_equals_its_forward_pass():
    model = _model(positions="rotary")
    inputs, _, _, segment_ids = _packed_and_unpacked()[0]
    full = model(inputs, segment_ids=segment_ids).numpy()
    cache = model.empty_cache(1, 16)
    for index in range(16):
        step, cache = model(inputs[:, index:index + 1], cache=cache, cache_index=index,
                            segment_ids=segment_ids)
        np.testing.assert_allclose(step.numpy()[:, 0], full[:, index], rtol=0, atol=1e-5)


# ---- Fine-tuning on packed data ---------------------------------------------------------------


def test_sft_on_packed_examples_learns_and_says_the_attention_runs_fused(tmp_path, tiny_data,
                                                                        capsys):
    from tests.test_instruction_data import TINY, WORDS, _train

    # Completions that follow from the prompt: "X Y" -> "Y X".
    words = WORDS[:8]
    examples = [{"prompt": f"{word} {other}", "completion": f"{other} {word}"}
                for word in words for other in words]
    code, data = _prepare(tmp_path, tiny_data, examples, "--pack")
    assert code == 0 and load_manifest(str(data))["packed"]
    common = ["--data", str(data), "--task", "sft", *TINY]
    _, before = _train([*common, "--out", str(tmp_path / "still"), "--steps", "1",
                        "--learning-rate", "1e-30"])
    startup = capsys.readouterr().out
    if kernels.library() is not None:  # the fused kernels take packed rows' segments
        assert "fused kernels: attention, " in startup
        assert "block-diagonal" not in startup
    _, after = _train([*common, "--out", str(tmp_path / "tuned"), "--steps", "40",
                       "--learning-rate", "0.02"])
    assert after["val_loss"] < before["val_loss"] - 0.5, (before["val_loss"], after["val_loss"])
