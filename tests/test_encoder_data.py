"""Encoder (BERT/ALBERT) pretraining data: prepare --format encoder, pairs and masks.

Oracles: the sentences the test wrote (every segment of every record must
be one of them, grouped by document), the raw records (every A/B pair must
be a record cut in two, swapped exactly when the label says so), and the
binomial distribution (masking and label rates on a fixed seed must fall
within 4 standard deviations of 15%, 80/10/10 and 50%).
"""

import glob
import math
import os
import random

import numpy as np
import pytest
import tensorflow as tf

from pipelines import prepare, reader
from pipelines.encoder_data import default_max_predictions, make_encoder_dataset
from pipelines.errors import DataError
from pipelines.tokenizer import Tokenizer
from tests.test_pipelines import WORDS, assert_follows_schema

SEQ_LEN = 40  # Records hold at most 37 tokens.
VOCABULARY_SIZE = 384
BATCH_SIZE = 32


def make_sentence_documents(count, seed):
    """Documents of 1 to 6 short sentences, some on separate lines."""
    generator = random.Random(seed)
    documents, sentences = [], []
    for index in range(count):
        parts = []
        for number in range(generator.randint(1, 6)):
            words = " ".join(generator.choice(WORDS) for _ in range(generator.randint(2, 4)))
            sentence = f"S{index}x{number} {words}."
            sentences.append(sentence)
            parts.append(sentence)
        separator = "\n" if generator.random() < 0.3 else " "
        documents.append(separator.join(parts))
    return documents, sentences


@pytest.fixture(scope="module")
def encoder_data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("encoder")
    documents, sentences = make_sentence_documents(400, seed=41)
    with open(directory / "corpus.txt", "w") as corpus_file:
        corpus_file.write("\n\n".join(documents) + "\n")
    manifest = prepare.prepare(
        str(directory / "data"),
        [str(directory / "corpus.txt")],
        seq_len=SEQ_LEN,
        vocabulary_size=VOCABULARY_SIZE,
        record_format="encoder",
        shard_size=6000,
        val_fraction=0.1,
        workers=1,
        log=lambda message: None,
    )
    return {"dir": str(directory / "data"), "manifest": manifest, "sentences": sentences}


def raw_records(data_dir, manifest, split="train"):
    """Every record as (tokens, segment_lengths), via plain TFRecordDataset."""
    records = []
    for shard in manifest["splits"][split]["shards"]:
        for serialized in tf.data.TFRecordDataset(os.path.join(data_dir, shard["filename"])):
            example = tf.train.Example.FromString(serialized.numpy())
            tokens = list(example.features.feature["token_ids"].int64_list.value)
            lengths = list(example.features.feature["segment_lengths"].int64_list.value)
            records.append((tokens, lengths))
    return records


def test_prepare_writes_segment_records_with_reserved_special_ids(encoder_data):
    data_dir, manifest = encoder_data["dir"], encoder_data["manifest"]
    assert manifest["format"] == "tfgpt-encoder-segments" and manifest["format_version"] == 2
    assert_follows_schema(manifest)
    assert manifest["record_length"] == SEQ_LEN - 3
    description = manifest["tokenizer"]
    assert [description[key] for key in ("pad_id", "unk_id", "eos_id")] == [0, 1, 2]
    assert [description[key] for key in ("cls_id", "sep_id", "mask_id")] == [3, 4, 5]
    tokenizer = Tokenizer.load(data_dir)
    assert [tokenizer.id_to_piece(index) for index in (3, 4, 5, 6)] == [
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "<0x00>",
    ]
    assert 5 not in tokenizer.encode("a literal [MASK] is text")
    sentences = set(encoder_data["sentences"])
    records = raw_records(data_dir, manifest)
    assert len(records) == manifest["splits"]["train"]["sequences"]
    segments_seen = 0
    for tokens, lengths in records:
        assert 2 <= len(tokens) == sum(lengths) <= SEQ_LEN - 3
        position = 0
        document = None
        for length in lengths:
            text = tokenizer.decode(tokens[position : position + length])
            position += length
            assert text in sentences
            # One record, one document: the sentence tags share the document number.
            number = text.split("x")[0]
            assert document in (None, number)
            document = number
            segments_seen += 1
    assert segments_seen == manifest["splits"]["train"]["segments"]
    # Documents are grouped greedily: most records hold several sentences.
    assert np.mean([len(lengths) for _, lengths in records]) > 1.5


def examples(data_dir, task="sop", batches=60, **options):
    dataset = make_encoder_dataset(
        data_dir, "train", BATCH_SIZE, task=task, seed=options.pop("seed", 12), **options
    )
    features, labels = {}, {}
    for batch_features, batch_labels in dataset.take(batches):
        for key, value in batch_features.items():
            features.setdefault(key, []).append(value.numpy())
        for key, value in batch_labels.items():
            labels.setdefault(key, []).append(value.numpy())
    return (
        {key: np.concatenate(value) for key, value in features.items()},
        {key: np.concatenate(value) for key, value in labels.items()},
    )


def restore_originals(features, labels):
    """token_ids with the masked positions' original tokens put back."""
    original = features["token_ids"].copy()
    for row in range(len(original)):
        for position, token, weight in zip(
            features["mask_positions"][row], labels["mask_ids"][row], labels["mask_weights"][row]
        ):
            if weight:
                original[row, position] = token
    return original


def pair(original_row, segment_row, mask_row):
    """(A, B) token lists of one example."""
    length = int(mask_row.sum())
    tokens = original_row[:length].tolist()
    segments = segment_row[:length].tolist()
    first_end = segments.index(1) - 1  # The [SEP] closing A.
    return tokens[1:first_end], tokens[first_end + 1 : length - 1]


def within_binomial(successes, trials, probability, deviations=4.0):
    return abs(successes - trials * probability) <= deviations * math.sqrt(
        trials * probability * (1 - probability)
    )


def test_sop_examples_layout_masking_and_labels(encoder_data):
    data_dir, manifest = encoder_data["dir"], encoder_data["manifest"]
    features, labels = examples(data_dir, "sop")
    max_predictions = default_max_predictions(SEQ_LEN)
    assert features["token_ids"].shape == (60 * BATCH_SIZE, SEQ_LEN)
    assert features["mask_positions"].shape == (60 * BATCH_SIZE, max_predictions)
    assert labels["mask_weights"].dtype == np.float32
    original = restore_originals(features, labels)
    padding = features["padding_mask"].astype(bool)
    lengths = padding.sum(axis=1)
    # Layout: [CLS] A [SEP] B [SEP] [PAD]...
    assert (original[:, 0] == 3).all()
    assert ((original == 4) & padding).sum(axis=1).tolist() == [2] * len(original)
    assert (original[np.arange(len(original)), lengths - 1] == 4).all()
    assert (original[~padding] == 0).all() and (features["segment_ids"][~padding] == 0).all()
    # Masking never touches specials or padding.
    weights = labels["mask_weights"].astype(bool)
    rows = np.repeat(np.arange(len(original))[:, None], max_predictions, axis=1)
    chosen_originals = original[rows[weights], features["mask_positions"][weights]]
    assert not np.isin(chosen_originals, [0, 3, 4]).any()
    assert padding[rows[weights], features["mask_positions"][weights]].all()
    np.testing.assert_array_equal(labels["mask_ids"][weights], chosen_originals)
    assert (labels["mask_ids"][~weights] == 0).all()
    assert (features["mask_positions"][~weights] == 0).all()
    # 15% of the real, non-special tokens (rounded per example).
    candidates = (lengths - 3).sum()
    masked = weights.sum()
    assert abs(masked / candidates - 0.15) < 0.02, masked / candidates
    # 80% [MASK], 10% random, 10% unchanged.
    after = features["token_ids"][rows[weights], features["mask_positions"][weights]]
    to_mask = (after == 5).sum()
    unchanged = (after == chosen_originals).sum()
    random_tokens = masked - to_mask - unchanged
    # A random replacement equals the original with probability ~1/vocabulary.
    assert within_binomial(to_mask, masked, 0.8)
    assert within_binomial(random_tokens, masked, 0.1 * (1 - 1 / VOCABULARY_SIZE))
    assert within_binomial(unchanged, masked, 0.1 + 0.1 / VOCABULARY_SIZE)
    assert after[after != 5].min() >= 6  # Random replacements are never special.
    # Sentence order: half swapped, and swapped pairs really are swapped.
    label = labels["sentence_order_label"]
    assert within_binomial(label.sum(), len(label), 0.5)
    records = {tuple(tokens) for tokens, _ in raw_records(data_dir, manifest)}
    for row in range(len(original)):
        first, second = pair(original[row], features["segment_ids"][row], padding[row])
        assert first and second
        in_order = tuple(second + first) if label[row] else tuple(first + second)
        assert in_order in records


def test_nsp_pairs_random_second_segments(encoder_data):
    data_dir, manifest = encoder_data["dir"], encoder_data["manifest"]
    features, labels = examples(data_dir, "nsp", batches=30)
    label = labels["next_sentence_label"]
    assert within_binomial(label.sum(), len(label), 0.5)
    original = restore_originals(features, labels)
    records = [tuple(tokens) for tokens, _ in raw_records(data_dir, manifest)]
    whole = set(records)
    contiguous = 0
    for row in range(len(original)):
        first, second = pair(
            original[row], features["segment_ids"][row], features["padding_mask"][row].astype(bool)
        )
        assert any(record[: len(first)] == tuple(first) for record in records)
        if label[row] == 0:
            assert tuple(first + second) in whole
        contiguous += tuple(first + second) in whole
    # Random seconds almost never continue their first segment.
    assert contiguous <= (label == 0).sum() + 0.05 * label.sum()


def test_masks_are_seeded_and_change_every_epoch(encoder_data):
    data_dir = encoder_data["dir"]
    first, _ = examples(data_dir, batches=3, shuffle=False, deterministic=True)
    again, _ = examples(data_dir, batches=3, shuffle=False, deterministic=True)
    other, _ = examples(data_dir, batches=3, shuffle=False, deterministic=True, seed=13)
    np.testing.assert_array_equal(first["token_ids"], again["token_ids"])
    assert (first["mask_positions"] != other["mask_positions"]).any()
    # Unshuffled, epoch 2 starts with the same records as epoch 1, masked anew.
    steps = reader.steps_per_epoch(data_dir, "train", BATCH_SIZE)
    both, _ = examples(data_dir, batches=steps + 1, shuffle=False, deterministic=True)
    first_epoch = both["mask_positions"][:BATCH_SIZE]
    second_epoch = both["mask_positions"][steps * BATCH_SIZE :]
    assert (first_epoch != second_epoch).any()


def test_encoder_iterator_resumes_exactly(encoder_data, tmp_path):
    data_dir = encoder_data["dir"]

    def build():
        return make_encoder_dataset(
            data_dir,
            "train",
            4,
            task="nsp",
            seed=3,
            deterministic=True,
            shuffle_buffer=32,
            num_shards=2,
            shard_index=1,
        )

    iterator = iter(build())
    for _ in range(5):
        next(iterator)
    path = tf.train.Checkpoint(iterator=iterator).save(str(tmp_path / "ckpt"))
    expected = [next(iterator) for _ in range(6)]
    restored = iter(build())
    tf.train.Checkpoint(iterator=restored).restore(path)
    for (features, labels), (expected_features, expected_labels) in zip(
        (next(restored) for _ in range(6)), expected
    ):
        for key in features:
            np.testing.assert_array_equal(features[key], expected_features[key])
        for key in labels:
            np.testing.assert_array_equal(labels[key], expected_labels[key])


def test_batches_feed_albert_and_bert_pretraining_models(encoder_data):
    from tfgpt import Albert, Bert

    data_dir, manifest = encoder_data["dir"], encoder_data["manifest"]
    tiny = dict(
        vocabulary_size=manifest["tokenizer"]["vocabulary_size"],
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=SEQ_LEN,
    )
    for model, task, head in (
        (Albert(embedding_dim=8, **tiny), "sop", "sop_logits"),
        (Bert(**tiny), "nsp", "nsp_logits"),
    ):
        features, labels = next(iter(make_encoder_dataset(data_dir, "train", 2, task=task)))
        outputs = model(features)
        assert outputs["mlm_logits"].shape == (
            2,
            default_max_predictions(SEQ_LEN),
            tiny["vocabulary_size"],
        )
        assert outputs[head].shape == (2, 2)
        loss = tf.keras.losses.sparse_categorical_crossentropy(
            labels["mask_ids"], outputs["mlm_logits"], from_logits=True
        )
        assert np.isfinite(float(tf.reduce_sum(loss * labels["mask_weights"])))


def test_encoder_data_errors(encoder_data, tmp_path):
    data_dir = encoder_data["dir"]
    with pytest.raises(
        ValueError, match=r"`task` must be one of \('sop', 'nsp'\). Received: task='mlm'"
    ):
        make_encoder_dataset(data_dir, "train", 2, task="mlm")
    with pytest.raises(
        ValueError,
        match=r"`max_predictions` must be an int in \[1, seq_len=40\]. "
        r"Received: max_predictions=41",
    ):
        make_encoder_dataset(data_dir, "train", 2, max_predictions=41)
    with pytest.raises(ValueError, match=r"`mask_rate` must be in \(0, 1\). Received: mask_rate=0"):
        make_encoder_dataset(data_dir, "train", 2, mask_rate=0)
    with pytest.raises(
        DataError,
        match=r"holds 'tfgpt-encoder-segments' records, make_dataset reads .*make_encoder_dataset",
    ):
        reader.make_dataset(data_dir, "train", 2)
    # A GPT tokenizer has no [CLS]/[SEP]/[MASK]: it cannot make encoder data.
    gpt_tokenizer = tmp_path / "gpt.model"
    from pipelines.tokenizer import train_tokenizer

    train_tokenizer(encoder_data["sentences"], 300, str(gpt_tokenizer), num_threads=1)
    corpus = glob.glob(os.path.join(os.path.dirname(data_dir), "*.txt"))
    with pytest.raises(
        ValueError, match=r"--format encoder needs a tokenizer with \[CLS\], \[SEP\] and \[MASK\]"
    ):
        prepare.prepare(
            str(tmp_path / "out"),
            corpus,
            seq_len=SEQ_LEN,
            tokenizer_path=str(gpt_tokenizer),
            record_format="encoder",
            log=lambda message: None,
        )
