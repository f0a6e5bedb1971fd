"""Tensor-parallel operators against unsplit autodiff: run under horovodrun -np 2 (or 4).

Each rank builds its tensor group from `ParallelState(size, tensor=2)`
and computes, inside a tf.function, with its slice of the same random
weights (every rank draws the whole weights from one seed):

- a Megatron MLP, f -> column-parallel matmul -> GELU -> row-parallel
  matmul (g) + bias, its output and the gradients of its input, of its
  slice of both kernels and of the bias;
- the vocabulary-parallel embedding lookup and cross-entropy, the
  per-token losses and the gradients of the table slice and the hidden
  states, with the table tied as the output layer.

It writes OUT/operators-rank-R.npz with each result beside the oracle:
the same function of the whole weights by plain TensorFlow autodiff, the
oracle's gradients cut to this rank's slice. The cross-entropy's oracle
is NumPy's log-sum-exp.
"""

import os
import sys

os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfgpt.parallel.state import ParallelState  # noqa: E402
from tfgpt.parallel.tensor_parallel import TensorSlice  # noqa: E402

BATCH, LENGTH, WIDTH, INNER, VOCABULARY = 3, 5, 6, 8, 10


def main():
    out = sys.argv[1]
    hvd.init()
    layout = ParallelState(hvd.size(), tensor=2)
    tensor_set = layout.process_sets(hvd, hvd.rank())["tensor"]
    index = layout.coordinates(hvd.rank())[2]
    group = TensorSlice(hvd, tensor_set, layout.tensor, index)

    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(BATCH, LENGTH, WIDTH)), tf.float32)
    first = tf.constant(rng.normal(size=(WIDTH, INNER)), tf.float32)
    second = tf.constant(rng.normal(size=(INNER, WIDTH)), tf.float32)
    bias = tf.constant(rng.normal(size=(WIDTH,)), tf.float32)
    table = tf.constant(rng.normal(size=(VOCABULARY, WIDTH)), tf.float32)
    # Every id, and both slices' ids in each row.
    ids = tf.constant(rng.permutation(np.arange(BATCH * LENGTH) % VOCABULARY).reshape(
        BATCH, LENGTH), tf.int32)
    targets = tf.constant(rng.integers(0, VOCABULARY, (BATCH, LENGTH)), tf.int32)
    inner_start, inner_count = group.rows(INNER)
    vocabulary_start, vocabulary_count = group.rows(VOCABULARY)
    weights = tf.constant(rng.normal(size=(BATCH, LENGTH, WIDTH)), tf.float32)

    class Dense:  # what row_parallel reads of a keras Dense
        def __init__(self, kernel, bias):
            self.kernel, self.bias = kernel, bias

    @tf.function
    def split_mlp(x, first, second, bias):
        with tf.GradientTape() as tape:
            tape.watch([x, first, second, bias])
            hidden = tf.nn.gelu(tf.matmul(group.copy_to_group(x), first))
            y = group.row_parallel(Dense(second, bias), hidden)
            objective = tf.reduce_sum(y * weights)
        return (y, *tape.gradient(objective, [x, first, second, bias]))

    @tf.function
    def whole_mlp(x, first, second, bias):
        with tf.GradientTape() as tape:
            tape.watch([x, first, second, bias])
            y = tf.matmul(tf.nn.gelu(tf.matmul(x, first)), second) + bias
            objective = tf.reduce_sum(y * weights)
        return (y, *tape.gradient(objective, [x, first, second, bias]))

    cut = slice(inner_start, inner_start + inner_count)
    got = split_mlp(x, first[:, cut], second[cut], bias)
    expected = whole_mlp(x, first, second, bias)
    results = {
        "mlp_output": (got[0], expected[0]),
        "mlp_input_gradient": (got[1], expected[1]),
        "mlp_first_gradient": (got[2], expected[2][:, cut]),
        "mlp_second_gradient": (got[3], expected[3][cut]),
        "mlp_bias_gradient": (got[4], expected[4]),
    }

    @tf.function
    def split_language_model(table, hidden):
        with tf.GradientTape() as tape:
            tape.watch([table, hidden])
            embedded = group.embed(table, ids)  # (B, T, C)
            logits = tf.matmul(group.copy_to_group(hidden + embedded), table, transpose_b=True)
            losses = group.cross_entropy(targets, logits)  # (B, T)
            objective = tf.reduce_sum(losses * tf.range(1.0, LENGTH + 1.0))
        return (embedded, losses, *tape.gradient(objective, [table, hidden]))

    @tf.function
    def whole_language_model(table, hidden):
        with tf.GradientTape() as tape:
            tape.watch([table, hidden])
            embedded = tf.gather(table, ids)
            logits = tf.matmul(hidden + embedded, table, transpose_b=True)
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)
            objective = tf.reduce_sum(losses * tf.range(1.0, LENGTH + 1.0))
        return (embedded, logits, *tape.gradient(objective, [table, hidden]))

    rows = slice(vocabulary_start, vocabulary_start + vocabulary_count)
    got = split_language_model(table[rows], x)
    expected = whole_language_model(table, x)
    logits = expected[1].numpy().astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    numpy_losses = log_sum - np.take_along_axis(logits, targets.numpy()[..., None], -1)[..., 0]
    results.update({
        "embedding": (got[0], expected[0]),
        "cross_entropy": (got[1], numpy_losses),
        "table_gradient": (tf.convert_to_tensor(got[2]), tf.convert_to_tensor(expected[2])[rows]),
        "hidden_gradient": (got[3], expected[3]),
    })
    np.savez(
        os.path.join(out, f"operators-rank-{hvd.rank()}.npz"),
        **{f"{name}_got": np.asarray(pair[0]) for name, pair in results.items()},
        **{f"{name}_expected": np.asarray(pair[1]) for name, pair in results.items()},
    )


if __name__ == "__main__":
    main()
