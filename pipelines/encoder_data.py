"""BERT/ALBERT pretraining examples from encoder-format data, as tf.data transforms.

`python -m pipelines.prepare --format encoder` writes records of one
document's consecutive segments (sentences), at most `seq_len - 3` tokens:
int64 features `token_ids` (the segments back to back) and
`segment_lengths`. This module turns each record, freshly every epoch, into

    [CLS] A [SEP] B [SEP] [PAD] ...        (seq_len tokens)

- A/B split: with two or more segments, A is the first `k` of them for a
  uniform `k` in `[1, segments)`, B the rest; a single segment is cut in
  the middle. A and B are therefore contiguous text of one document.
- Sentence-order prediction (`task="sop"`, ALBERT, Lan et al. 2020): with
  probability 0.5 A and B are swapped; `sentence_order_label` is 1 when
  swapped (the convention of `tfgpt.models.albert.Albert`'s `sop_logits`).
- Next-sentence prediction (`task="nsp"`, BERT, Devlin et al. 2019): with
  probability 0.5 B is replaced by the B of another record (from a second,
  independently shuffled pass over this worker's records) and truncated to
  fit; `next_sentence_label` is 1 for such a random B (the convention of
  `tfgpt.models.bert.Bert`'s `nsp_logits`).
- Dynamic masked-LM masking (`mask_tokens`): of the real, non-special
  tokens (never [CLS], [SEP] or padding), `round(mask_rate * n)` (at least
  1, at most `max_predictions`) positions are chosen uniformly; each is
  replaced by [MASK] with probability 0.8, by a uniformly random non-special
  token with probability 0.1, and left unchanged with probability 0.1.

Every random choice is a stateless function of `(seed, example index)`,
where the index counts examples across epochs: examples differ every epoch,
are reproducible, and the pipeline stays checkpointable (no `py_function`).

Special ids come from the manifest's tokenizer: [CLS] = 3, [SEP] = 4,
[MASK] = 5 and [PAD] = 0 for tfgpt's SentencePiece encoder tokenizers and
WordPiece alike; random replacements are drawn from the ids above the
largest special id.

Each element is `(features, labels)`:

- features: `token_ids`, `segment_ids` (0 for [CLS] A [SEP], 1 for B [SEP]),
  `padding_mask` (1 at real tokens), all int32 (B, seq_len), and
  `mask_positions` int32 (B, max_predictions), padded with 0 — exactly the
  inputs of `tfgpt.models.bert.Bert` and `tfgpt.models.albert.Albert`.
- labels: `mask_ids` int32 (B, max_predictions), the original tokens at
  `mask_positions` (0 in padding slots), `mask_weights` float32 (1 for real
  predictions, 0 for padding slots), and `sentence_order_label` or
  `next_sentence_label` int32 (B,).

Example:

>>> dataset = make_encoder_dataset("data/bert", "train", batch_size=32)  # doctest: +SKIP
>>> features, labels = next(iter(dataset))  # doctest: +SKIP
>>> outputs = tfgpt.models.albert.Albert.from_preset("albert-base")(features)  # doctest: +SKIP
"""

import math
from typing import Optional

import tensorflow as tf

from pipelines import reader
from pipelines.manifest import ENCODER_FEATURES, ENCODER_FORMAT

TASKS = ("sop", "nsp")
DEFAULT_MASK_RATE = 0.15
MASK_TOKEN_PROBABILITY = 0.8
RANDOM_TOKEN_PROBABILITY = 0.1
# Salts that give each random decision its own stream from one seed pair.
_CUT_SALT, _ORDER_SALT, _CHOICE_SALT, _REPLACE_SALT, _RANDOM_TOKEN_SALT = range(1, 6)
_PARTNER_SEED_OFFSET = 1_000_003


def default_max_predictions(seq_len: int, mask_rate: float = DEFAULT_MASK_RATE) -> int:
    """`ceil(seq_len * mask_rate)`: 20 for 128 tokens, as BERT used."""
    return max(1, math.ceil(seq_len * mask_rate))


def _salted(seed, salt):
    return tf.random.experimental.stateless_fold_in(seed, salt)


def mask_tokens(
    token_ids,
    candidates,
    seed,
    *,
    mask_rate: float,
    max_predictions: int,
    mask_id: int,
    random_token_low: int,
    vocabulary_size: int,
):
    """Dynamic masked-LM masking of one example (BERT's 80/10/10 rule).

    Args:
        token_ids: int32 tensor (T,).
        candidates: bool tensor (T,). Positions that may be masked (real,
            non-special tokens).
        seed: int64 tensor (2,). Stateless seed of this example.
        mask_rate: float. Share of the candidates to predict.
        max_predictions: int. Fixed number of prediction slots P (<= T).
        mask_id: int. The [MASK] id.
        random_token_low: int. Random replacements are drawn from
            `[random_token_low, vocabulary_size)`.
        vocabulary_size: int.

    Returns:
        (masked_token_ids (T,), mask_positions (P,), mask_ids (P,),
        mask_weights (P,) float32). Positions ascend; unused slots have
        position 0, id 0 and weight 0.
    """
    length = tf.shape(token_ids)[0]
    number_of_candidates = tf.reduce_sum(tf.cast(candidates, tf.int32))
    wanted = tf.cast(tf.round(tf.cast(number_of_candidates, tf.float32) * mask_rate), tf.int32)
    number_to_mask = tf.minimum(
        tf.minimum(tf.maximum(wanted, 1), max_predictions), number_of_candidates
    )
    scores = tf.where(
        candidates, tf.random.stateless_uniform([length], seed=_salted(seed, _CHOICE_SALT)), -1.0
    )  # (T,)
    chosen = tf.math.top_k(scores, k=max_predictions).indices  # (P,), best scores first
    valid = tf.range(max_predictions) < number_to_mask  # (P,)
    # Ascending positions, unused slots last.
    order = tf.argsort(tf.where(valid, chosen, length + chosen))
    positions = tf.where(valid, tf.gather(chosen, order), 0)  # valid is already a prefix
    labels = tf.where(valid, tf.gather(token_ids, positions), 0)  # (P,)
    draw = tf.random.stateless_uniform([max_predictions], seed=_salted(seed, _REPLACE_SALT))
    random_tokens = tf.random.stateless_uniform(
        [max_predictions],
        seed=_salted(seed, _RANDOM_TOKEN_SALT),
        minval=random_token_low,
        maxval=vocabulary_size,
        dtype=tf.int32,
    )
    replacements = tf.where(
        draw < MASK_TOKEN_PROBABILITY,
        mask_id,
        tf.where(draw < MASK_TOKEN_PROBABILITY + RANDOM_TOKEN_PROBABILITY, random_tokens, labels),
    )  # (P,)
    updated = tf.tensor_scatter_nd_update(
        token_ids,
        tf.boolean_mask(positions, valid)[:, tf.newaxis],  # (M, 1)
        tf.boolean_mask(replacements, valid),  # (M,)
    )
    return updated, positions, labels, tf.cast(valid, tf.float32)


def _parse_record(serialized):
    tokens_feature, lengths_feature = ENCODER_FEATURES
    parsed = tf.io.parse_single_example(
        serialized,
        {
            tokens_feature: tf.io.VarLenFeature(tf.int64),
            lengths_feature: tf.io.VarLenFeature(tf.int64),
        },
    )
    tokens = tf.cast(parsed[tokens_feature].values, tf.int32)  # (N,)
    lengths = tf.cast(parsed[lengths_feature].values, tf.int32)  # (S,)
    return tokens, lengths


def _split_record(tokens, lengths, seed):
    """(A, B): a random segment boundary, or the middle of a single segment."""
    number_of_segments = tf.size(lengths)
    k = tf.random.stateless_uniform(
        [],
        seed=_salted(seed, _CUT_SALT),
        minval=1,
        maxval=tf.maximum(number_of_segments, 2),
        dtype=tf.int32,
    )
    boundary = tf.reduce_sum(lengths[:k])
    cut = tf.where(number_of_segments >= 2, boundary, tf.size(tokens) // 2)
    return tokens[:cut], tokens[cut:]


def make_encoder_dataset(
    data_dir: str,
    split: str,
    batch_size: int,
    *,
    task: str = "sop",
    mask_rate: float = DEFAULT_MASK_RATE,
    max_predictions: Optional[int] = None,
    shuffle: bool = True,
    seed: int = 0,
    repeat: bool = True,
    num_shards: int = 1,
    shard_index: int = 0,
    input_context: Optional[tf.distribute.InputContext] = None,
    shuffle_buffer: int = reader.DEFAULT_SHUFFLE_BUFFER,
    deterministic: bool = False,
    verify_checksums: bool = False,
    equal_steps: Optional[bool] = None,
    skip_corrupt: bool = False,
) -> tf.data.Dataset:
    """BERT/ALBERT pretraining batches `(features, labels)` for one worker.

    Args:
        data_dir: str. A directory written by `pipelines.prepare --format encoder`.
        split: str. "train" or "val".
        batch_size: int. Per-worker batch size; partial batches are dropped.
        task: str. "sop" (sentence order, ALBERT) or "nsp" (next sentence, BERT).
        mask_rate: float in (0, 1). Share of real tokens to predict.
        max_predictions: int or None. Prediction slots per example, at most
            `seq_len`; None uses `default_max_predictions(seq_len, mask_rate)`.
        shuffle, seed, repeat, num_shards, shard_index, input_context,
        shuffle_buffer, deterministic, verify_checksums, equal_steps,
        skip_corrupt: as for `pipelines.reader.make_dataset` (the same worker
            sharding, equal steps, checkpointable iterators). `seed` also
            keys the masks and pairs.

    Returns:
        tf.data.Dataset of `(features, labels)`; see the module docstring.
    """
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}. Received: task={task!r}")
    if not isinstance(mask_rate, (int, float)) or not 0.0 < mask_rate < 1.0:
        raise ValueError(f"`mask_rate` must be in (0, 1). Received: mask_rate={mask_rate!r}")
    manifest, num_shards, shard_index = reader.open_data_dir(
        data_dir,
        ENCODER_FORMAT,
        "make_encoder_dataset",
        batch_size=batch_size,
        num_shards=num_shards,
        shard_index=shard_index,
        input_context=input_context,
        shuffle_buffer=shuffle_buffer,
    )
    seq_len = manifest["seq_len"]
    if max_predictions is None:
        max_predictions = default_max_predictions(seq_len, mask_rate)
    if (
        isinstance(max_predictions, bool)
        or not isinstance(max_predictions, int)
        or not 1 <= max_predictions <= seq_len
    ):
        raise ValueError(
            f"`max_predictions` must be an int in [1, seq_len={seq_len}]. "
            f"Received: max_predictions={max_predictions!r}"
        )
    tokenizer = manifest["tokenizer"]
    cls_id, sep_id, mask_id, pad_id = (
        tokenizer["cls_id"],
        tokenizer["sep_id"],
        tokenizer["mask_id"],
        tokenizer["pad_id"],
    )
    vocabulary_size = tokenizer["vocabulary_size"]
    random_token_low = 1 + max(
        tokenizer[key] for key in ("pad_id", "unk_id", "eos_id", "cls_id", "sep_id", "mask_id")
    )
    sharding = dict(
        shuffle=shuffle,
        repeat=repeat,
        num_shards=num_shards,
        shard_index=shard_index,
        shuffle_buffer=shuffle_buffer,
        deterministic=deterministic,
        verify_checksums=verify_checksums,
        skip_corrupt=skip_corrupt,
    )
    records = reader.worker_records(
        manifest, data_dir, split, batch_size, seed=seed, equal_steps=equal_steps, **sharding
    )
    # A global example counter (across epochs) keys every random choice.
    dataset = records.enumerate()
    if task == "nsp":
        partners = reader.worker_records(
            manifest,
            data_dir,
            split,
            batch_size,
            seed=seed + _PARTNER_SEED_OFFSET,
            equal_steps=False,
            **dict(sharding, shuffle=True, repeat=True, skip_corrupt=skip_corrupt),
        )
        dataset = tf.data.Dataset.zip((dataset, partners)).map(
            lambda indexed, partner: (indexed[0], indexed[1], partner)
        )
    else:
        dataset = dataset.map(lambda index, record: (index, record, record))
    room = seq_len - 3

    def build_example(index, serialized, partner_serialized):
        example_seed = tf.stack([tf.constant(seed, tf.int64), index])  # (2,)
        tokens, lengths = _parse_record(serialized)
        first, second = _split_record(tokens, lengths, example_seed)
        label_draw = tf.random.stateless_uniform([], seed=_salted(example_seed, _ORDER_SALT))
        label = tf.cast(label_draw < 0.5, tf.int32)
        if task == "sop":
            first, second = tf.cond(label > 0, lambda: (second, first), lambda: (first, second))
        else:
            partner_tokens, partner_lengths = _parse_record(partner_serialized)
            _, random_second = _split_record(
                partner_tokens, partner_lengths, _salted(example_seed, _PARTNER_SEED_OFFSET)
            )
            second = tf.cond(label > 0, lambda: random_second, lambda: second)
            second = second[: room - tf.size(first)]  # A record fits; a random B may not.
        length = tf.size(first) + tf.size(second) + 3
        token_ids = tf.concat([[cls_id], first, [sep_id], second, [sep_id]], axis=0)
        token_ids = tf.pad(token_ids, [[0, seq_len - length]], constant_values=pad_id)
        token_ids = tf.ensure_shape(token_ids, [seq_len])  # (T,)
        positions = tf.range(seq_len)
        padding_mask = positions < length  # (T,)
        segment_ids = tf.cast((positions >= tf.size(first) + 2) & padding_mask, tf.int32)  # (T,)
        candidates = padding_mask & (token_ids != cls_id) & (token_ids != sep_id)
        masked, mask_positions, mask_ids, mask_weights = mask_tokens(
            token_ids,
            candidates,
            example_seed,
            mask_rate=mask_rate,
            max_predictions=max_predictions,
            mask_id=mask_id,
            random_token_low=random_token_low,
            vocabulary_size=vocabulary_size,
        )
        features = {
            "token_ids": masked,
            "segment_ids": segment_ids,
            "padding_mask": tf.cast(padding_mask, tf.int32),
            "mask_positions": mask_positions,
        }
        label_name = "sentence_order_label" if task == "sop" else "next_sentence_label"
        labels = {"mask_ids": mask_ids, "mask_weights": mask_weights, label_name: label}
        return features, labels

    dataset = dataset.map(
        build_example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic
    )
    dataset = dataset.batch(batch_size, drop_remainder=True)
    return dataset.prefetch(tf.data.AUTOTUNE)
