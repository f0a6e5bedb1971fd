"""Reading instruction records (`pipelines.prepare --format instructions`) for fine-tuning a GPT.

Each record is one example: its `token_ids` (prompt, completion, EOS) and
`learned` (1 on the completion's tokens and the EOS). A batch is
`(inputs, targets, weights)`, int32, int32 and float32, each
`(batch_size, seq_len)`: the example's tokens but the last, the tokens
after them, and whether each target is learned. An example shorter than
the record is padded with token 0 at weight 0, after its end, where a
causal model's earlier positions never look, so padding changes no loss.

Packed records (`prepare --pack`) hold several examples each, and a batch
is `(inputs, targets, weights, segment_ids)`: `segment_ids` (int32,
`(batch_size, seq_len)`) numbers each input token's example, 1, 2, ... in
its row, 0 for the padding. The model takes them (`tfgpt.models.GPT`'s
`segment_ids`): positions restart and attention stays within each example.
A target in the next example (the first token of an example, after the
EOS before it) has weight 0: no one predicts an example's first token.

The loss over such batches is the weighted mean of the token losses, over
the global batch (`tfgpt.training.train_step.TrainStep`'s `token_weights`).
"""

from typing import Optional

import tensorflow as tf

from pipelines import reader
from pipelines.manifest import INSTRUCTION_FEATURES, INSTRUCTION_FORMAT, SEGMENT_FEATURE


def make_instruction_dataset(
    data_dir: str,
    split: str,
    batch_size: int,
    *,
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
    cursor: Optional[int] = None,
) -> tf.data.Dataset:
    """Fine-tuning batches `(inputs, targets, weights)` for one worker.

    Args:
        data_dir: str. A directory written by `pipelines.prepare --format
            instructions`.
        split: str. "train" or "val".
        batch_size: int. Per-worker batch size; partial batches are dropped.
        shuffle, seed, repeat, num_shards, shard_index, input_context,
        shuffle_buffer, deterministic, verify_checksums, equal_steps,
        skip_corrupt, cursor: as for `pipelines.reader.make_dataset` (the same
            worker sharding, equal steps, checkpointable iterators).

    Returns:
        tf.data.Dataset of `(inputs, targets, weights)`, and `segment_ids`
        after them for packed records; see the module docstring.
    """
    manifest, num_shards, shard_index = reader.open_data_dir(
        data_dir,
        INSTRUCTION_FORMAT,
        "make_instruction_dataset",
        batch_size=batch_size,
        num_shards=num_shards,
        shard_index=shard_index,
        input_context=input_context,
        shuffle_buffer=shuffle_buffer,
    )
    records = reader.worker_records(
        manifest, data_dir, split, batch_size, shuffle=shuffle, seed=seed, repeat=repeat,
        num_shards=num_shards, shard_index=shard_index, shuffle_buffer=shuffle_buffer,
        deterministic=deterministic, equal_steps=equal_steps, verify_checksums=verify_checksums,
        skip_corrupt=skip_corrupt, cursor=cursor,
    )
    length = manifest["record_length"]  # seq_len + 1
    packed = bool(manifest.get("packed"))
    names = INSTRUCTION_FEATURES + ((SEGMENT_FEATURE,) if packed else ())
    features = {name: tf.io.VarLenFeature(tf.int64) for name in names}

    def pad(values):  # (T',) -> (seq_len + 1,), zeros after the example
        values = tf.cast(values, tf.int32)
        values = tf.pad(values, [[0, length - tf.size(values)]])
        return tf.ensure_shape(values, [length])

    def example(serialized):
        parsed = tf.io.parse_single_example(serialized, features)
        token_ids, learned, *segments = (pad(tf.sparse.to_dense(parsed[name]))
                                         for name in names)
        weights = tf.cast(learned[1:], tf.float32)
        if not packed:
            return token_ids[:-1], token_ids[1:], weights
        segment_ids = segments[0]  # (seq_len + 1,)
        # An example's first token is the target of the EOS before it: not learned.
        weights *= tf.cast(tf.equal(segment_ids[1:], segment_ids[:-1]), tf.float32)
        return token_ids[:-1], token_ids[1:], weights, segment_ids[:-1]

    dataset = records.map(example, num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=deterministic or cursor is not None)
    return dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
