"""Tensor parallelism: one rank's slice of every block, and the operators between slices.

Megatron-LM's layout (Shoeybi et al. 2019): within a tensor group of T
ranks, each rank holds

- h/T of each block's attention heads: the query/key/value projection is
  column-parallel (its output columns, head by head, are cut) and the
  output projection row-parallel (its input rows are cut);
- I/T of the feed-forward width: the first matmul column-parallel, the
  second row-parallel;
- V/T of the vocabulary: rows of the token embedding (and of an untied
  output layer), so each rank computes the logits of its own V/T ids and
  the cross-entropy combines them without gathering the logits.

Everything else (layer norms, position embedding, the row-parallel
layers' biases) is replicated. Two conjugate operators join the slices,
each one all-reduce over the tensor group:

- f (`copy_to_group`): identity forward, sum of the gradients backward.
  Before a column-parallel layer: every slice reads the same input, so
  the input's gradient is the sum of the slices' contributions.
- g (`reduce_from_group`): sum forward, identity backward. After a
  row-parallel layer: the slices' partial products add up to the output.

(A bare `hvd.allreduce` as g would have Horovod's registered gradient,
another all-reduce, and double every gradient.) With these, replicated
parameters get the same gradient on every rank of a group, so gradients
are averaged over the data group only.

Which weights are split, and how, is data (`SPLIT_RULES`, by the layer
and variable names that end a variable's path), read by the layers when
they are built and by `split_rules` (ZeRO, the checkpoint, the pipeline's
gradient norm) from the variables' paths. The layers take their slice when
they are built inside `slice_scope`; outside it (and for T = 1) they hold
`WHOLE`, whose operators are the plain ones, so a layer runs one code path
at every T and the model code never asks whether it is split.

Example (under `horovodrun -np 2`):
>>> tensor_slice = TensorSlice(hvd, process_set, size=2, index=hvd.rank())
>>> with slice_scope(tensor_slice):
...     model = GPT.from_preset("gpt-demo")  # each rank: half the heads
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfgpt import kernels

# Megatron-LM's layout as data: the weights a tensor slice cuts, keyed by the layer and
# variable names that end their path (`gpt/block_0/attention/query_key_value/kernel`), and how:
# `(axis, groups)` (`take_slice`). The one decoder block serves every decoder family
# (`tfgpt.models.decoder_families`), so this one table is every family's. Every other weight
# (norms, position table, the row-parallel layers' biases) is replicated.
SPLIT_RULES = {
    "token_embedding/embeddings": (0, 1),  # the vocabulary's rows
    # Column-parallel: the heads' columns of q, k and v (3 groups), of q, of k and v (2).
    "query_key_value/kernel": (1, 3), "query_key_value/bias": (0, 3),
    "query/kernel": (1, 1), "query/bias": (0, 1),
    "key_value/kernel": (1, 2), "key_value/bias": (0, 2),
    "output_projection/kernel": (0, 1),  # row-parallel: the heads' rows
    "feedforward_gate/kernel": (1, 1), "feedforward_gate/bias": (0, 1),
    "feedforward_intermediate/kernel": (1, 1), "feedforward_intermediate/bias": (0, 1),
    "feedforward_output/kernel": (0, 1),
    "lm_head/kernel": (1, 1), "lm_head/bias": (0, 1),  # the vocabulary's columns
    # Low-rank adapters (x A B) split as their kernel: B's columns under a column-parallel
    # kernel, A's rows under a row-parallel one; the other matrix is replicated.
    "query_key_value/adapter_b": (1, 3), "query/adapter_b": (1, 1),
    "key_value/adapter_b": (1, 2), "output_projection/adapter_a": (0, 1),
    "feedforward_gate/adapter_b": (1, 1), "feedforward_intermediate/adapter_b": (1, 1),
    "feedforward_output/adapter_a": (0, 1),
}

# Added to the seed of a dropout in a split region (attention
# probabilities) times the slice index, so each slice draws its own masks
# while the replicated regions' dropouts keep equal seeds (equal masks).
_SEED_STRIDE = 1_000_003


class WholeSlice:
    """The tensor slice of a model built whole (T = 1): each operator is the plain one.

    Layers and models outside `slice_scope` hold `WHOLE`, with the same
    methods as a `TensorSlice`: nothing is cut, marked or summed.
    """

    size, index, process_set = 1, 0, None

    def rows(self, total, what="size"):
        return 0, total

    def initializer(self, initializer, whole_shape, rule):
        return initializer

    def copy_to_group(self, x):
        return x

    def row_parallel(self, dense, x):
        return dense(x)

    def embed_tokens(self, embedding, ids):
        return embedding(ids)

    def seed_dropout(self, dropout):
        """Nothing to offset: one slice."""

    def global_norm(self, gradients, split):
        return tf.linalg.global_norm(gradients)

    def cross_entropy(self, targets, logits):
        """Per-token cross-entropy (B, T); tfgpt.kernels: one pass over the
        logits in their own dtype on CPU."""
        return kernels.sparse_cross_entropy(tf.cast(targets, "int32"), logits)


WHOLE = WholeSlice()
# The slice the layers built now take.
_current = [WHOLE]


@contextlib.contextmanager
def slice_scope(tensor_slice):
    """Layers created inside take `tensor_slice`'s part (None or T = 1: `WHOLE`)."""
    previous = _current[0]
    _current[0] = tensor_slice if tensor_slice is not None and tensor_slice.size > 1 else WHOLE
    try:
        yield
    finally:
        _current[0] = previous


def current_slice():
    """The `TensorSlice` of layers being built now (`WHOLE`: whole layers)."""
    return _current[0]


def split_rows(total, size, index, what="size"):
    """`(start, count)` of slice `index` of `size` equal slices of `total`.

    Raises unless `size` divides `total` (`what` names the quantity).
    """
    if total % size:
        raise ValueError(
            f"--tensor-parallel {size} must divide `{what}`. Received: {what}={total}, "
            f"tensor_parallel={size}"
        )
    count = total // size
    return index * count, count


def take_slice(whole, rule, size, index):
    """Slice `index` of `size` of the array `whole` (NumPy) under `rule`.

    Args:
        whole: array of the unsplit variable.
        rule: `(axis, groups)`: `axis` is cut; it holds `groups` equal
            parts (3 for the fused query/key/value: queries, keys,
            values), each cut in `size` and the slice's parts kept in order.
        size: int. T.
        index: int. Which slice.

    Example:
    >>> take_slice(np.arange(12).reshape(2, 6), (1, 3), 2, 1)
    array([[ 1,  3,  5],
           [ 7,  9, 11]])
    """
    whole = np.asarray(whole)
    axis, groups = rule
    axis %= whole.ndim
    shape = whole.shape
    grouped = whole.reshape(shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1:])
    width = shape[axis] // groups // size
    part = np.take(grouped, np.arange(index * width, (index + 1) * width), axis=axis + 1)
    return part.reshape(shape[:axis] + (groups * width,) + shape[axis + 1:])


def join_slices(slices, rule):
    """The whole array from its `len(slices)` slices (`take_slice`'s inverse)."""
    slices = [np.asarray(part) for part in slices]
    axis, groups = rule
    axis %= slices[0].ndim
    shape = slices[0].shape
    grouped = [part.reshape(shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1:])
               for part in slices]
    whole = np.concatenate(grouped, axis=axis + 1)
    return whole.reshape(shape[:axis] + (shape[axis] * len(slices),) + shape[axis + 1:])


def sliced_initializer(initializer, tensor_slice, whole_shape, rule):
    """An initializer of this slice's part of what `initializer` gives the whole variable.

    The whole variable is drawn and cut, so a model built in slices starts
    from the slices of the unsplit model built from the same seed.
    """
    initializer = keras.initializers.get(initializer)

    def initialize(shape, dtype=None):
        whole = initializer(whole_shape, dtype=dtype)
        return take_slice(whole, rule, tensor_slice.size, tensor_slice.index)

    return initialize


def split_rule(path):
    """The `SPLIT_RULES` rule of the variable at `path` when built in slices, or None."""
    return SPLIT_RULES.get("/".join(path.split("/")[-2:]))


def split_rules(model):
    """`{id(variable): rule}` of the split variables of a model built in slices
    (none for a whole model)."""
    if getattr(model, "tensor_slice", WHOLE).size == 1:
        return {}
    return {id(variable): split_rule(variable.path) for variable in model.variables
            if split_rule(variable.path) is not None}


def check_sizes(tensor, model_config):
    """Raises a ValueError naming the first size of the model that `--tensor-parallel` cannot split.

    (What it does not combine with: `tfgpt.parallel.refusals`.)

    Args:
        tensor: int. T (1: nothing to check).
        model_config: the resolved model config.
    """
    if tensor == 1:
        return
    for name in ("num_heads", "intermediate_dim"):
        split_rows(getattr(model_config, name), tensor, 0, name)
    # Grouped-query attention: each slice holds whole key-value heads.
    split_rows(model_config.key_value_heads, tensor, 0, "num_key_value_heads")
    if model_config.vocabulary_size % tensor:
        padded = -(-model_config.vocabulary_size // tensor) * tensor
        raise ValueError(
            f"--tensor-parallel {tensor} must divide `vocabulary_size`. Received: "
            f"vocabulary_size={model_config.vocabulary_size}, tensor_parallel={tensor}; pad "
            f"it with --vocabulary-size {padded} (ids the tokenizer never emits)"
        )


def split_seed_states(model):
    """The seed states of the dropouts in split regions (each slice offsets its own)."""
    return [layer.seed_generator.state for layer in model.sublayers()
            if getattr(layer, "split_region", False)]


def whole_parameters(model):
    """`model.count_params()` of the whole model, from one slice of it (T x each split variable)."""
    tensor_slice = getattr(model, "tensor_slice", WHOLE)
    rules = split_rules(model)
    split = sum(int(np.prod(v.shape)) for v in model.trainable_variables if id(v) in rules)
    return model.count_params() + (tensor_slice.size - 1) * split


class TensorSlice:
    """This rank's place in its tensor group, and the collectives over the group.

    Args:
        hvd: the `horovod.tensorflow` module.
        process_set: the group's Horovod process set.
        size: int. T, ranks in the group.
        index: int. This rank's slice, 0 to T - 1.
    """

    def __init__(self, hvd, process_set, size, index):
        self._hvd = hvd
        self.process_set = process_set
        self.size = size
        self.index = index

    def rows(self, total, what="size"):
        """`(start, count)` of this slice's part of `total` rows."""
        return split_rows(total, self.size, self.index, what)

    def initializer(self, initializer, whole_shape, rule):
        """`sliced_initializer` of this slice."""
        return sliced_initializer(initializer, self, whole_shape, rule)

    def _reduce(self, x, op):
        # Horovod's CPU reductions take float32, not bfloat16.
        dtype = x.dtype
        wide = tf.cast(x, tf.float32) if dtype not in (tf.float32, tf.float64) else x
        reduced = self._hvd.allreduce(wide, op=op, process_set=self.process_set)
        return tf.cast(reduced, dtype)

    def sum(self, x):
        """Sum over the group (Horovod's own gradient: do not differentiate through it)."""
        return self._reduce(x, self._hvd.Sum)

    def copy_to_group(self, x):
        """Megatron's f: identity forward, sum of the gradients over the group backward."""

        @tf.custom_gradient
        def f(x):
            return tf.identity(x), lambda upstream: self.sum(upstream)

        return f(x)

    def reduce_from_group(self, x):
        """Megatron's g: sum over the group forward, identity backward."""

        @tf.custom_gradient
        def g(x):
            return self.sum(x), lambda upstream: tf.identity(upstream)

        return g(x)

    def row_parallel(self, dense, x):
        """A row-parallel `keras.layers.Dense` on this slice's inputs `x` (..., n/T).

        The slices' partial products (an adapter's too) are summed (g), then
        the replicated bias is added once.
        """
        y = tf.matmul(x, tf.cast(dense.kernel, x.dtype))
        if getattr(dense, "adapter_rank", 0):  # its rows of A are this slice's
            y = y + tf.cast(dense.adapter_output(x), y.dtype)
        y = self.reduce_from_group(y)
        if dense.bias is not None:
            y = y + tf.cast(dense.bias, y.dtype)
        return y

    def embed(self, table, ids):
        """Looks `ids` (B, T) up in this slice's rows `table` (V/T, C) of the vocabulary.

        Ids outside the slice give zero rows here; the sum over the group
        (g) gives every rank the whole embedding.
        """
        start = self.index * table.shape[0]
        local = ids - start  # (B, T)
        inside = tf.logical_and(local >= 0, local < table.shape[0])  # (B, T)
        rows = tf.gather(table, tf.where(inside, local, 0))  # (B, T, C)
        rows = rows * tf.cast(inside, rows.dtype)[..., tf.newaxis]  # (B, T, C)
        return self.reduce_from_group(rows)

    def embed_tokens(self, embedding, ids):
        """`embed` of the vocabulary rows the `keras.layers.Embedding` holds."""
        return self.embed(tf.cast(embedding.embeddings, embedding.compute_dtype), ids)

    def global_norm(self, gradients, split):
        """The global norm of the whole model's gradients, on every rank of the group.

        `split[i]` tells whether `gradients[i]` is a slice (its squares are
        summed over the group) or replicated (the same on every rank:
        counted once).
        """
        squares = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in gradients]
        sliced = tf.add_n([s for s, is_split in zip(squares, split) if is_split] or [0.0])
        replicated = tf.add_n([s for s, is_split in zip(squares, split) if not is_split] or [0.0])
        return tf.sqrt(self.sum(sliced) + replicated)

    def seed_dropout(self, dropout):
        """Gives `dropout` (a split region's) this slice's own random stream."""
        dropout.split_region = True  # split_seed_states finds it
        self.offset_seed(dropout.seed_generator.state)

    def offset_seed(self, state):
        """Offsets a dropout's seed state (a [seed, counter] variable) by this slice's index."""
        state.assign(state.value + tf.constant([self.index * _SEED_STRIDE, 0], state.dtype))

    def cross_entropy(self, targets, logits):
        """Per-token cross-entropy (B, T) from this slice's logits (B, T, V/T), float32.

        The logits are never gathered: the group agrees on each token's
        maximum logit (one all-reduce), then sums the exponentials and the
        target's logit, which exactly one slice holds (one all-reduce of
        both). The gradient, softmax minus the one-hot target, needs only
        this slice's part of each, so the backward pass has no collective.
        """
        logits = tf.cast(logits, tf.float32)
        count = logits.shape[-1]
        local = tf.cast(targets, tf.int32) - self.index * count  # (B, T)
        inside = tf.logical_and(local >= 0, local < count)  # (B, T)

        @tf.custom_gradient
        def losses_of(logits):
            maximum = self._reduce(tf.reduce_max(logits, axis=-1), self._hvd.Max)  # (B, T)
            shifted = logits - maximum[..., tf.newaxis]  # (B, T, V/T)
            exponentials = tf.exp(shifted)  # (B, T, V/T)
            picked = tf.gather(shifted, tf.where(inside, local, 0), batch_dims=2)  # (B, T)
            picked = tf.where(inside, picked, 0.0)
            sums = self.sum(
                tf.stack([tf.reduce_sum(exponentials, axis=-1), picked], axis=-1)
            )  # (B, T, 2): the softmax's denominator, the target's shifted logit
            losses = tf.math.log(sums[..., 0]) - sums[..., 1]  # (B, T)

            def gradient(upstream):
                softmax = exponentials / sums[..., 0:1]  # (B, T, V/T)
                # one_hot gives a zero row for an index outside [0, V/T).
                target = tf.one_hot(tf.where(inside, local, -1), count)  # (B, T, V/T)
                return (softmax - target) * upstream[..., tf.newaxis]

            return losses, gradient

        return losses_of(logits)
