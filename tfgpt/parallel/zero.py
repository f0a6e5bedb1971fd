"""ZeRO: sharded data parallelism over Horovod (Rajbhandari et al. 2020).

Every data-parallel worker normally holds the whole model, its gradients
and both optimizer moments: about 16 bytes per float32 parameter on every
rank. `ZeroSharding` cuts that state along the first dimension of each
trainable variable, one slice per rank (`shard_rows`), in three stages:

- stage 1: the optimizer state. Each rank keeps a float32 copy of its
  slice of every variable (the "shard") and the optimizer's moments for
  it; each bucket of gradients is reduce-scattered (averaged, each rank
  receiving only its rows) as soon as the backward pass has computed it,
  each rank updates its shards, and the updated shards are all-gathered
  into every rank's whole variables. With gradient accumulation the
  micro-batches' whole gradients are added up first.
- stage 2: and the gradients: with accumulation each micro-batch's
  gradients are reduce-scattered and only the rows are added up, so no
  rank holds whole gradients between micro-batches (without accumulation
  stages 1 and 2 run the same step).
- stage 3: and the parameters. The model's variables give up their
  storage; only the shards persist. Each transformer block all-gathers its
  weights when it runs and lets go of them after (with `--recompute` the
  backward pass gathers them again instead of keeping them), the rest of
  the model (embeddings, final norm, heads) is gathered around the loss,
  and the backward pass of every gather is a reduce-scatter of the whole
  gradients into averaged shard gradients.

Horovod's own gradients of its collectives do not fit this (the gradient
of `allgather` averages, that of a summing `reducescatter` is N times the
sum): the gathers here carry their own `tf.custom_gradient`. Bytes per
rank of float32 parameters, gradients and AdamW's two moments, with P
parameters and N ranks (`state_bytes`): stage 0 16P; stage 1 8P + 12P/N;
stage 2 4P + 16P/N; stage 3 16P/N, plus the weights gathered for the unit
that runs (one block, or the embeddings and heads) and their gradients.

Every rank runs the same collectives in the same order, and every
collective's output is used (a pruned collective would leave its peers
waiting).

Under tensor or pipeline parallelism, or both (stage 1), the shards are
cut over the data group (`tfgpt.parallel.state`): the ranks that hold
the same tensor slice of the same pipeline stage, one per data replica;
N is then the data replicas, and every collective runs on the data
group's process set. A tensor-parallel model's global norm adds its
slices' squares over the tensor group; a pipeline stage's step
(`tfgpt.parallel.pipeline_executor`) shards only the stage's
variables and gives `apply` the norm over every stage (and slice).

Stage 0 is `Unsharded`, with the same interface: the run core, the steps
and the checkpoint ask the run's sharding (`shard_state` builds it) and
never which stage runs.

Example (under `horovodrun -np 2`):
>>> sharding = ZeroSharding(2, model, optimizer, distribution)
>>> sharding.shards[0].shape  # the first rows of the first variable
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfgpt.layers.transformer_block import TransformerBlock
from tfgpt.parallel.horovod_bridge import gradient_buckets
from tfgpt.parallel.tensor_parallel import WHOLE, split_rules
from tfgpt.parallel.unallocated import allocated

STAGES = (0, 1, 2, 3)

# The optimizer slots that are sharded with their variables: AdamW's and
# LAMB's first and second moments (`tfgpt.optim.optimizers`), by the
# attribute that lists them in variable order.
SLOTS = {"momentum": "_momentums", "velocity": "_velocities"}


def slot_variables(optimizer):
    """`{slot name: [variable per trainable variable]}` of a built optimizer."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return {name: list(getattr(inner, attribute, [])) for name, attribute in SLOTS.items()}


def replicated_optimizer_variables(optimizer):
    """The optimizer's variables that are not moments: its counters, the loss scale."""
    moments = {id(v) for variables in slot_variables(optimizer).values() for v in variables}
    return [v for v in optimizer.variables if id(v) not in moments]


def shard_state(model, optimizer, distribution, variables=None):
    """The run's sharding of `variables` (the model's trainable ones by
    default; a pipeline stage's): `ZeroSharding` at the distribution's ZeRO
    stage 1-3, cut from rank 0's weights, or `Unsharded`; the optimizer is
    built on what this rank updates."""
    stage = distribution.state.zero_stage
    if not stage:
        sharding = Unsharded(model, optimizer, distribution, variables)
        optimizer.build(sharding.variables)
        return sharding
    distribution.broadcast_variables([v for v in model.variables if allocated(v)])
    return ZeroSharding(stage, model, optimizer, distribution, variables=variables)


class Unsharded:
    """ZeRO stage 0: every rank of a data group holds the whole state of what it trains.

    Whole gradients are averaged through the distribution and update the
    variables on every rank. `ZeroSharding`'s interface, for the steps
    (`gradient_sources` ... `apply`) and for the run core (`held`,
    `broadcast_set`, `after_restore`, `largest_unit`, `materialize`).

    Args:
        model: keras.Model (of this rank's tensor slice).
        optimizer: the run's optimizer (None: a step that does not train).
        distribution: its `allreduce_gradients` averages the gradients
            (None: one process).
        variables: what this rank trains (a pipeline stage's), or None for
            the model's trainable variables.
    """

    stage = 0
    runs_collectives = False  # XLA may compile its update with the step
    loop_parallelism = 10  # tf.while_loop's default: micro-batches may overlap

    def __init__(self, model, optimizer=None, distribution=None, variables=None):
        self.model = model
        self.optimizer = optimizer
        self.distribution = distribution
        self.variables = list(model.trainable_variables if variables is None else variables)
        self.tensor_slice = getattr(model, "tensor_slice", WHOLE)
        rules = split_rules(model)
        self._split = [id(variable) in rules for variable in self.variables]

    def gradient_sources(self):
        return [variable.value for variable in self.variables]

    def loss_scope(self):
        return contextlib.nullcontext()

    def reduce_micro_batch(self, gradients):
        return gradients

    def reduce_accumulated(self, gradients):
        return self.distribution.allreduce_gradients(gradients)

    def apply(self, gradients, loss_scale=None, norm=None):
        """Updates the variables; returns the global norm of the unscaled
        gradients (`norm` when given: a pipeline's, over every stage)."""
        if norm is None:
            norm = self.tensor_slice.global_norm(gradients, self._split)
        if loss_scale is not None:
            # A tensor slice's gradients are its own: NaN on every rank of the group
            # when any slice overflowed, so every `LossScaleOptimizer` skips the step.
            poison = norm - norm
            gradients = [g + tf.cast(poison, g.dtype) for g in gradients]
            norm = norm / tf.cast(loss_scale, norm.dtype)
        # An optimizer that clips by the global norm (FusedAdamW) takes this
        # one instead of computing it again: one pass over the gradients less.
        # Under tensor parallelism it must: its own would be this slice's alone.
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        given_norm = getattr(inner, "given_gradient_norm", None)
        with given_norm(norm) if given_norm else contextlib.nullcontext():
            self.optimizer.apply(gradients, self.variables)
        return norm

    def held(self, index, data_index):
        """`(holder, rows, writes)` of trained variable `index`: the variable
        that holds this rank's part, its rows `(start, stop, of)` (None:
        all of them) and whether this rank, data replica `data_index` now
        (an elastic run's changes), writes them to a checkpoint: the first
        replica does."""
        return self.variables[index], None, data_index == 0

    def broadcast_set(self):
        """What rank 0 of each data group sends its group at start-up."""
        return ([v for v in self.model.variables if allocated(v)]
                + list(self.optimizer.variables))

    def after_restore(self):
        """Nothing to rebuild after a checkpoint's values are loaded."""

    def materialize(self):
        """The whole weights are already there."""

    def largest_unit(self):
        return 0


def idle_sharding_warning(distribution):
    """A warning (str) when `--zero-stage` has nothing to shard over, else None."""
    stage = distribution.state.zero_stage
    if not stage or distribution.size > 1:
        return None
    return (
        f"--zero-stage {stage} with one worker shards nothing: every state stays whole on "
        "it, as with --zero-stage 0" + (", plus a float32 copy of the weights (4 bytes per "
                                        "parameter more)" if stage in (1, 2) else "")
    )


def shard_rows(rows, size):
    """`(counts, offsets)`: how `rows` rows are split over `size` ranks.

    Horovod's own split for `reducescatter` and uneven `allgather`: the
    first `rows % size` ranks get one row more.

    Example:
    >>> shard_rows(5, 3)
    ([2, 2, 1], [0, 2, 4])
    """
    base, extra = divmod(rows, size)
    counts = [base + (1 if rank < extra else 0) for rank in range(size)]
    offsets = [sum(counts[:rank]) for rank in range(size)]
    return counts, offsets


def state_bytes(parameters, stage, size, gathered=0):
    """Bytes per rank of float32 parameters, gradients and AdamW moments.

    Args:
        parameters: int. Trainable parameters of the model.
        stage: int. ZeRO stage.
        size: int. Data-parallel ranks.
        gathered: int. Stage 3: parameters of the largest unit gathered at
            once (`ZeroSharding.largest_unit`).

    Returns:
        dict of bytes: `parameters` (whole variables, and the float32
        shards of stages 1-3), `gradients` (at their peak in a step: whole
        in stages 0 and 1, this rank's rows in 2 and 3), `optimizer` (both
        moments), `state` (their sum), `gathered` (stage 3: the largest
        unit's whole weights and gradients, which exist only while it
        runs) and `total`.

    Example:
    >>> state_bytes(1000, 3, 2)["state"]
    8000
    """
    shard = -(-parameters // size)  # the largest rank's share
    result = {
        "parameters": 4 * {0: parameters, 1: parameters + shard, 2: parameters + shard,
                           3: shard}[stage],
        "gradients": 4 * (parameters if stage <= 1 else shard),
        "optimizer": 8 * (parameters if stage == 0 else shard),
    }
    result["state"] = sum(result.values())
    result["gathered"] = 8 * gathered if stage == 3 else 0
    result["total"] = result["state"] + result["gathered"]
    return result


def _released(variable):
    def read(*args, **kwargs):
        raise RuntimeError(
            f"{variable.path} is sharded (ZeRO stage 3): its value exists only while "
            "ZeroSharding gathers it (a block's call, the loss); read the whole weights "
            "with ZeroSharding.gather_weights()"
        )

    return read


class ZeroSharding:
    """The shards of a model's trainable variables and optimizer, and the step on them.

    Args:
        stage: int. 1, 2 or 3 (see the module docstring).
        model: keras.Model, built, with identical weights on every rank.
        optimizer: the run's optimizer, not yet built (a
            `LossScaleOptimizer` under float16); it is built on the shards.
        distribution: `HorovodDistribution`: its `layout` (this rank's
            data replica), `size` (the data replicas), `data_process_set`,
            `bucket_bytes` and Horovod module.
        variables: the trainable variables to shard (a pipeline stage's),
            or None for the model's.

    The step (`tfgpt.training.train_step.TrainStep`) asks it for the
    variables to differentiate (`gradient_sources`), the loss under the
    gathered weights (`loss_scope`), what to do with each micro-batch's
    gradients (`reduce_micro_batch`) and with their mean
    (`reduce_accumulated`), and applies the update with `apply`.
    """

    def __init__(self, stage, model, optimizer, distribution, variables=None):
        if stage not in STAGES[1:]:
            raise ValueError(f"`stage` must be 1, 2 or 3. Received: stage={stage!r}")
        self.stage = stage
        self.model = model
        self.optimizer = optimizer
        self._hvd = distribution._hvd
        # This rank's place in its data group, and the group's collectives.
        self.rank = distribution.state.data_index
        self.size = distribution.size
        process_set = distribution.data_process_set
        self._where = {} if process_set is None else {"process_set": process_set}
        self.bucket_bytes = distribution.bucket_bytes
        self.variables = list(model.trainable_variables if variables is None else variables)
        # Tensor parallelism: which variables are slices, for the global norm.
        self.tensor_slice = getattr(model, "tensor_slice", WHOLE)
        rules = split_rules(model)
        self._split = [id(variable) in rules for variable in self.variables]
        self.counts, self.offsets = [], []
        shards = []
        for variable in self.variables:
            if len(variable.shape) == 0:
                raise ValueError(
                    f"ZeRO shards variables along their first axis; {variable.path} is a scalar"
                )
            counts, offsets = shard_rows(variable.shape[0], self.size)
            self.counts.append(counts)
            self.offsets.append(offsets)
            start, count = offsets[self.rank], counts[self.rank]
            # The same name as the whole variable: the optimizer's weight
            # decay exclusions match on it. A copy of the rows: TensorFlow's
            # slice along the first axis shares the whole variable's buffer,
            # which would then outlive the variable (stage 3 releases it).
            rows = tf.raw_ops.DeepCopy(x=variable.value[start:start + count])
            shards.append(keras.Variable(
                rows, trainable=True, name=variable.name, dtype=variable.dtype,
            ))
        self.shards = shards
        self.optimizer.build(self.shards)
        self.inner_optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        self.slot_variables = slot_variables(optimizer)
        if hasattr(self.inner_optimizer, "norm_sum"):
            # LAMB's trust ratio needs the norms of whole variables.
            self.inner_optimizer.norm_sum = self.sum_over_ranks
        self.units = []
        if stage == 3:
            self._install_gathers()

    # --- what the step differentiates and reduces ---------------------------------

    # Micro-batches one after the other: each runs collectives of the same
    # names, which must not overlap.
    loop_parallelism = 1
    runs_collectives = True  # its update all-gathers: XLA cannot compile it

    def gradient_sources(self):
        """The tf.Variables whose gradients the backward pass computes."""
        if self.stage == 3:
            return [shard.value for shard in self.shards]
        return [variable.value for variable in self.variables]

    def loss_scope(self):
        """Where the loss is computed: stage 3 gathers the weights outside the blocks."""
        if self.stage == 3:
            return self._gathered(self._rest)
        return contextlib.nullcontext()

    def reduce_micro_batch(self, gradients):
        """One micro-batch's local gradients -> what is accumulated."""
        if self.stage == 2:
            return self._reduce_scatter(gradients)
        return gradients  # stage 1: whole, reduced once; stage 3: already shards

    def reduce_accumulated(self, gradients):
        """The accumulated gradients -> this rank's averaged shard gradients."""
        if self.stage != 1:
            return gradients
        return self._reduce_scatter(gradients)

    def _reduce_scatter(self, gradients):
        if self.size == 1:  # a data group of one rank (T or P ranks in all): no process set
            return list(gradients)
        shards = [None] * len(gradients)
        for bucket in gradient_buckets(gradients, self.bucket_bytes):
            # (Horovod 0.28.1's grouped_reducescatter takes no name: the
            # ranks of a ZeRO run run the same towers, so their gradients'
            # names agree; HorovodDistribution.agree_on_towers.)
            reduced = self._hvd.grouped_reducescatter(
                [gradients[index] for index in bucket], op=self._hvd.Average, **self._where
            )
            for index, shard in zip(bucket, reduced):
                shards[index] = shard
        return shards

    def sum_over_ranks(self, values):
        """Sums a float32 vector over the data group (partial norms, overflow flags)."""
        if self.size == 1:
            return values
        return self._hvd.allreduce(values, op=self._hvd.Sum, **self._where)

    # --- the update -----------------------------------------------------------------

    def squares(self, shard_gradients):
        """The sum of squares of the whole averaged gradients, from every rank's shards."""
        squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
                            for g in shard_gradients] or [tf.constant(0.0)])
        return self.sum_over_ranks(tf.reshape(squares, [1]))[0]

    def global_norm(self, shard_gradients):
        """The global norm of the whole averaged gradients, from every rank's shards.

        Of the whole model's under tensor parallelism: the slices' squares
        summed over the tensor group, the replicated variables' once.
        """
        if self.tensor_slice.size == 1:
            return tf.sqrt(self.squares(shard_gradients))
        squares = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in shard_gradients]
        sliced = tf.add_n([s for s, split in zip(squares, self._split) if split] or [0.0])
        replicated = tf.add_n([s for s, split in zip(squares, self._split) if not split] or [0.0])
        sliced, replicated = tf.unstack(self.sum_over_ranks(tf.stack([sliced, replicated])))
        return tf.sqrt(self.tensor_slice.sum(sliced) + replicated)

    def apply(self, shard_gradients, loss_scale=None, norm=None):
        """Updates the shards (and, in stages 1 and 2, the whole variables).

        Returns the global norm of the unscaled gradients (`norm` when
        given: a pipeline's, over every stage). Under float16 loss scaling
        an overflow on any rank makes every rank's gradients non-finite,
        so every rank's `LossScaleOptimizer` skips the step.
        """
        if norm is None:
            norm = self.global_norm(shard_gradients)
        if loss_scale is not None:
            # NaN everywhere when the norm (of every rank's shards) is not finite.
            poison = norm - norm
            shard_gradients = [g + tf.cast(poison, g.dtype) for g in shard_gradients]
            norm = norm / tf.cast(loss_scale, norm.dtype)
        given_norm = getattr(self.inner_optimizer, "given_gradient_norm", None)
        with given_norm(norm) if given_norm else contextlib.nullcontext():
            self.optimizer.apply(shard_gradients, self.shards)
        if self.stage in (1, 2):
            with tf.control_dependencies([norm]):
                self._gather_into_variables()
        return norm

    def _gather_into_variables(self):
        values = [shard.value for shard in self.shards]
        if self.size == 1:
            for variable, value in zip(self.variables, values):
                variable.assign(value)
            return
        # Buckets cut by the whole variables' sizes, the same on every rank
        # (the shards' sizes differ when the rows do not divide evenly).
        wholes = [tf.TensorSpec(v.shape, v.dtype) for v in self.variables]
        for bucket in gradient_buckets(wholes, self.bucket_bytes):
            gathered = self._hvd.grouped_allgather([values[index] for index in bucket],
                                                   **self._where)
            for index, value in zip(bucket, gathered):
                self.variables[index].assign(value)

    def gather_weights(self):
        """The whole value of every trainable variable, in model order (all ranks call it)."""
        if self.size == 1:
            return [shard.value for shard in self.shards]
        return self._hvd.grouped_allgather([shard.value for shard in self.shards], **self._where)

    def held(self, index, data_index=None):
        """`(holder, rows, writes)` of trained variable `index` (`Unsharded.held`):
        this rank's shard, its rows, and whether it has any."""
        start, count = self.offsets[index][self.rank], self.counts[index][self.rank]
        return self.shards[index], (start, start + count, self.variables[index].shape[0]), count > 0

    def broadcast_set(self):
        """What rank 0 of each data group sends its group at start-up: what is
        not sharded (the weights were cut from rank 0's)."""
        return ([v for v in self.model.non_trainable_variables if allocated(v)]
                + replicated_optimizer_variables(self.optimizer))

    def after_restore(self):
        """After a checkpoint's shards are loaded, stages 1 and 2 gather the whole weights."""
        self.load_shards([shard.value for shard in self.shards])

    def load_shards(self, values):
        """Assigns this rank's shard values and, in stages 1 and 2, gathers the whole weights."""
        for shard, value in zip(self.shards, values):
            shard.assign(value)
        if self.stage in (1, 2):
            self._gather_into_variables()

    # --- stage 3: weights that exist only while they are used -----------------------

    def _install_gathers(self):

        index_of = {id(variable): index for index, variable in enumerate(self.variables)}
        in_blocks = set()
        for layer in self.model.sublayers():
            if isinstance(layer, TransformerBlock):
                indices = [index_of[id(v)] for v in layer.trainable_variables]
                in_blocks.update(indices)
                layer.weights_scope = (
                    lambda inputs, indices=indices: self._gathered(indices, after=inputs)
                )
                self.units.append(indices)
        self._rest = [index for index in range(len(self.variables)) if index not in in_blocks]
        self.units.append(self._rest)
        for variable in self.variables:
            variable._value = None  # the storage goes; only the shards persist
            variable._initializer = _released(variable)

    def materialize(self):
        """Gives every variable its whole value back and stops gathering (stage 3).

        For what runs the whole model after training (a fine-tuning's
        predictions); the step must not run again.
        """
        if self.stage != 3:
            return
        for variable, value in zip(self.variables, self.gather_weights()):
            variable._initialize(value)
        for layer in self.model.sublayers():
            if isinstance(layer, TransformerBlock):
                layer.weights_scope = None
        self._rest = []

    def largest_unit(self):
        """Parameters of the largest set of weights gathered at once (stage 3)."""
        return max(
            (sum(int(np.prod(self.variables[i].shape)) for i in unit) for unit in self.units),
            default=0,
        )

    @contextlib.contextmanager
    def _gathered(self, indices, after=None):
        """The whole weights of `indices` while the context runs.

        With `after` (a block's inputs) the gather waits for that tensor.
        Otherwise nothing orders it: the shards are there from the start
        of the step, so the graph would run every block's all-gather at
        once and hold the whole model (in the backward pass, the
        recomputation's inputs wait for the upstream gradient, so its
        gathers follow the backward pass too).
        """
        if not indices:
            yield
            return
        # The tf.Variables themselves: `.value` inside a layer's call is
        # cast to the compute dtype (bfloat16), which Horovod cannot gather.
        shard_values = [self.shards[index]._value for index in indices]
        if after is not None:
            with tf.control_dependencies([after]):
                shard_values = [tf.identity(value) for value in shard_values]
        gathered = self._gather(shard_values)
        variables = [self.variables[index] for index in indices]
        for variable, value in zip(variables, gathered):
            # allgather leaves the first dimension unknown to the graph.
            variable._value = tf.ensure_shape(value, variable.shape)
        try:
            yield
        finally:
            for variable in variables:
                variable._value = None

    def _gather(self, shard_values):
        hvd, where = self._hvd, self._where

        @tf.custom_gradient
        def gather(*shards):
            # Reads of the shard variables go in, so the tape (and
            # tf.recompute_grad) reaches the variables through them.
            wholes = hvd.grouped_allgather(list(shards), **where)

            def gradient(*upstream):
                upstream = [
                    tf.zeros_like(whole) if g is None else tf.convert_to_tensor(g)
                    for g, whole in zip(upstream, wholes)
                ]
                return hvd.grouped_reducescatter(upstream, op=hvd.Average, **where)

            return wholes, gradient

        return gather(*[tf.convert_to_tensor(value) for value in shard_values])
