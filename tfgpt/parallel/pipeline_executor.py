"""Runs a pipeline schedule's ticks: the training step of a pipeline-parallel GPT.

Horovod has no point-to-point send and receive (horovod/horovod#1224,
#3418); an `alltoall` with splits serves as one. After each tick in which
some rank sends, every rank of the pipeline calls the same `alltoall`
(named after the tick, so that every rank's call is matched): a
rank that produced an activation or a gradient for another rank sends
it, `rows` rows to that rank and none to the others, and every other rank
sends zero rows. Which rank receives what, and at which offset, follows
from the schedule (`PipelineSchedule.transfers`), so nothing about the
shapes is exchanged. Ticks without transfers need no exchange.

The tick loop runs in Python, eagerly; each virtual stage's forward pass
is one `tf.function` and the optimizer update another, so what runs per
tick is compiled. A forward pass is recorded on its own
`tf.GradientTape` (the compiled function's intermediate results are kept
for its gradient), held until the micro-batch's backward pass asks the
tape for the gradients of the chunk's weights and of its input, given the
gradient of its output (`output_gradients`): the activations a schedule
keeps in flight are the ones TensorFlow holds. Eager collectives run in
the order they are called, the same on every rank. (One `tf.function`
for the whole step was tried: TensorFlow does not keep the exchanges in
program order on every rank, and two ranks that enqueue different ticks
first wait for each other for ever.)

One exchange is one Horovod cycle: `HOROVOD_CYCLE_TIME` (10 ms in
tfgpt's data-parallel runs) bounds how fast ticks go, and pipeline runs
lower it to 1 ms (`tfgpt.parallel.horovod_bridge`).
"""

import time

import tensorflow as tf

from tfgpt.graph_function import graph_function
from tfgpt.parallel.pipeline_schedule import BACKWARD, FORWARD
from tfgpt.parallel.tensor_parallel import split_rules
from tfgpt.parallel.zero import Unsharded
from tfgpt.training.train_step import STEP_TIMES, _dense, _loss_scale


class PipelineTrainStep:
    """Forward and backward passes by the schedule, one optimizer update per step.

    The batch, the same on every rank of the pipeline, is `(inputs,
    targets)` (B, T) each, or instruction records' `(inputs, targets,
    weights[, segment_ids])` (`--task sft`: `pipelines.instruction_data`);
    it is cut into `microbatches` micro-batches of B / M rows. Each
    micro-batch's loss counts by its share of the step's loss: 1 / M of a
    mean over tokens, so that the gradients are those of the whole batch
    at once; of a loss weighted per token, its weight total over the global
    batch's (summed over the data replicas) times the replicas, so that
    the replicas' average is the weighted mean over every learned token of
    the global batch, not a mean of the micro-batches' means (as
    `TrainStep`'s `token_weights`). The gradients are accumulated over the
    micro-batches, then (tied embeddings) the first and the last stage add
    each other's token-table gradients, then, with data parallelism,
    averaged over the replicas of the stage. The gradient norm is the
    global norm over all stages (the table counted once) and, with a
    model built in tensor slices, all slices, which clips every stage
    alike. (Under tensor parallelism a pipeline is the stages' ranks of
    one slice: the hidden states they exchange are whole.)

    Under float16 loss scaling (`optimizer` a `LossScaleOptimizer`) the
    last stage scales each micro-batch's loss by its optimizer's scale, so
    every stage's gradients (and the activation gradients sent back) are
    scaled by it; every stage's optimizer has the same scale, since an
    overflow on any stage makes the global norm non-finite and every stage
    skips the step (`Unsharded.apply`, `ZeroSharding.apply`).

    Args:
        stage: `tfgpt.parallel.pipeline_stage.PipelineStage` of this rank.
        optimizer: keras optimizer built on `stage.trainable_variables`.
        pipeline_set: Horovod process set of this rank's pipeline, ranks in
            stage order.
        data_set: Horovod process set of this stage's data-parallel
            replicas, or None without data parallelism.
        zero: `tfgpt.parallel.zero.ZeroSharding` of the stage's
            variables over `data_set` (`--zero-stage 1`): the accumulated
            gradients are then reduce-scattered over the replicas instead
            of averaged, and each rank updates its shards; or `Unsharded`
            or None (stage 0).
        timed: bool. Also return `tick_times`, `(start, end)` of each busy
            tick's computation, and `loop_time`, that of all the ticks
            (`time.perf_counter()` seconds; `bench/pipeline_schedules.py`).

    Calling it with a batch returns `loss` (the batch's loss, on every
    rank: its mean, or its share of the global weighted mean; the
    replicas' average is the global batch's loss), `gradient_norm` and `STEP_TIMES`
    (`tfgpt.training.train_step`): the seconds of this rank's ticks'
    computation, and of its waits (transfers, the other stages, the sums
    over the pipeline) up to the update.
    """

    def __init__(self, stage, optimizer, pipeline_set, data_set=None, timed=False, zero=None):
        import horovod.tensorflow as hvd

        self._hvd = hvd
        self.stage = stage
        self.schedule = stage.schedule
        self.optimizer = optimizer
        self.pipeline_set = pipeline_set
        self.data_set = data_set
        self.timed = timed
        self.zero = zero if getattr(zero, "stage", 0) else None
        self.variables = stage.trainable_variables
        # The update: ZeRO's on this rank's shards, or the stage's whole variables.
        self._sharding = zero or Unsharded(stage.model, optimizer, variables=self.variables)
        self._index = {id(v): index for index, v in enumerate(self.variables)}
        # One compiled forward pass per virtual stage of this rank, and the update.
        self._forward_passes = {
            stage_index: graph_function(
                lambda x, y, w, segments, s=stage_index: stage.forward(s, x, y, w, segments))
            for stage_index in stage.chunks
        }
        self._evaluations = {
            stage_index: graph_function(
                lambda x, y, w, segments, s=stage_index: stage.forward(s, x, y, w, segments,
                                                                       training=False))
            for stage_index in stage.chunks
        }
        self._update = graph_function(self._update_fn)
        if self.zero is not None:
            self._reduce_scatter = graph_function(self.zero.reduce_accumulated)

    def __call__(self, *batch):
        return self._step_fn(batch[0] if len(batch) == 1 else batch)

    # ---- one tick ----------------------------------------------------------------

    def _forward(self, operation, micro_batches, shares, received, saved):
        virtual_stage = self.stage.chunks[operation.chunk]
        index = operation.microbatch
        last = virtual_stage == self.stage.last
        inputs, targets, weights, segment_ids = micro_batches[index]
        with tf.GradientTape() as tape:
            if virtual_stage == 0:
                x = inputs  # token ids: nothing to differentiate
            else:
                x = received.pop((FORWARD, index, virtual_stage))
                tape.watch(x)
            y = self._forward_passes[virtual_stage](
                x, *((targets, weights) if last else (None, None)), segment_ids)
            if last:
                y = loss = y * shares[index]  # its part of the step's loss
                if _loss_scale(self.optimizer) is not None:
                    y = self.optimizer.scale_loss(y)
        saved[(index, virtual_stage)] = (tape, x, y)
        return (loss, None) if last else (None, y)

    def _backward(self, operation, received, saved, gradients):
        virtual_stage = self.stage.chunks[operation.chunk]
        index = operation.microbatch
        tape, x, y = saved.pop((index, virtual_stage))
        variables = self.stage.chunk_variables(virtual_stage)
        sources = [v.value for v in variables] + ([x] if virtual_stage > 0 else [])
        upstream = None
        if virtual_stage != self.stage.last:
            upstream = received.pop((BACKWARD, index, virtual_stage))
        results = tape.gradient(y, sources, output_gradients=upstream)
        for variable, gradient in zip(variables, results):
            if gradient is None:
                continue
            position = self._index[id(variable)]
            gradient = _dense(gradient)
            gradients[position] = (
                gradient if gradients[position] is None else gradients[position] + gradient)
        return results[-1] if virtual_stage > 0 else None

    def _exchange(self, tick, outgoing, rows, empty, received):
        """The tick's alltoall; files what this rank receives in `received`."""
        rank, transfers = self.stage.rank, self.schedule.transfers[tick]
        mine = [t for t in transfers if t.source == rank]
        splits = [0] * self.schedule.stages
        if mine:
            splits[mine[0].destination] = rows
        output = self._send(outgoing if mine else empty, splits, f"pipeline_tick_{tick}")
        # Rows arrive in the order of the sending ranks.
        incoming = sorted((t for t in transfers if t.destination == rank), key=lambda t: t.source)
        for offset, transfer in enumerate(incoming):
            key = (transfer.kind, transfer.microbatch, transfer.virtual_stage)
            received[key] = output[offset * rows:(offset + 1) * rows]  # (b, T, C)

    def _send(self, sent, splits, name):
        """One alltoall over the pipeline: `splits[r]` rows of `sent` to rank r;
        returns what this rank receives."""
        # Horovod's alltoall takes no bfloat16: its bits travel as uint16.
        bits = sent.dtype == tf.bfloat16
        output, _ = self._hvd.alltoall(tf.bitcast(sent, tf.uint16) if bits else sent,
                                       splits=splits, name=name, process_set=self.pipeline_set)
        return tf.bitcast(output, tf.bfloat16) if bits else output

    def _empty(self, length):
        """Zero rows of hidden states (0, T, C): what a rank with nothing to send sends."""
        model = self.stage.model
        return tf.zeros([0, length, model.hidden_dim], model.compute_dtype)

    # ---- the step -------------------------------------------------------------------

    def _micro_batches(self, batch):
        """`batch` cut into M micro-batches `(inputs, targets, weights,
        segment_ids)` of (b, T) each (None for what it lacks), and each
        one's share of the step's loss (see the class)."""
        count = self.schedule.microbatches
        parts = [[None] * count if part is None else tf.split(part, count)
                 for part in _fields(batch)]  # 4 x M x (b, T)
        weights = parts[2]
        if weights[0] is None:
            return list(zip(*parts)), [1.0 / count] * count
        sums = [tf.reduce_sum(tf.cast(part, "float32")) for part in weights]
        total, replicas = tf.add_n(sums), 1
        if self.data_set is not None:
            total = self._hvd.allreduce(total, op=self._hvd.Sum, name="pipeline_weight_total",
                                        process_set=self.data_set)
            replicas = self.data_set.size()
        return list(zip(*parts)), [part * replicas / tf.maximum(total, 1.0) for part in sums]

    def _step_fn(self, batch):
        micro_batches, shares = self._micro_batches(batch)
        inputs = micro_batches[0][0]
        rows = inputs.shape[0]
        empty = self._empty(inputs.shape[1])
        received, saved, losses, times = {}, {}, [], []
        gradients = [None] * len(self.variables)
        loop_begin = time.perf_counter()
        for tick in range(self.schedule.ticks):
            operation = self.schedule.timetable[self.stage.rank][tick]
            outgoing = None
            begin = time.perf_counter()
            if operation is not None and operation.kind == FORWARD:
                loss, outgoing = self._forward(operation, micro_batches, shares, received,
                                               saved)
                if loss is not None:
                    losses.append(loss)
                finished = loss if outgoing is None else outgoing
            elif operation is not None:
                outgoing = self._backward(operation, received, saved, gradients)
                finished = outgoing if outgoing is not None else next(
                    g for g in gradients if g is not None)
            if operation is not None:
                if self.timed:
                    _ = tf.reshape(finished, [-1])[:1].numpy()  # wait for the tick's last op
                times.append((begin, time.perf_counter()))
            if self.schedule.transfers[tick]:
                self._exchange(tick, outgoing, rows, empty, received)
        loop_time = (loop_begin, time.perf_counter())
        gradients = [tf.zeros_like(v.value) if g is None else g
                     for v, g in zip(self.variables, gradients)]
        gradients = self._sum_tied_table(gradients)
        if self.zero is not None:  # this rank's rows of the averaged gradients
            gradients = self._reduce_scatter(gradients)
        elif self.data_set is not None:
            gradients = self._hvd.grouped_allreduce(
                gradients, op=self._hvd.Average, process_set=self.data_set,
                name="pipeline_data_parallel")
        loss, gradient_norm = self._loss_and_norm(losses, gradients)
        busy = sum(end - begin for begin, end in times)
        waited = time.perf_counter() - loop_begin - busy
        # The norm of the unscaled gradients (under loss scaling, `gradient_norm` is not).
        gradient_norm = self._update(gradients, gradient_norm)
        # The loop's time split: the ticks' computation, and the waits for
        # transfers, for the other stages (the bubble) and for the sums.
        result = {"loss": loss, "gradient_norm": gradient_norm,
                  STEP_TIMES: tf.constant([busy, waited], tf.float64)}
        if self.timed:
            result["tick_times"], result["loop_time"] = times, loop_time
        return result

    def evaluate(self, batch):
        """`(loss, {})`: the batch's mean loss (weighted by its `weights`, if it
        has them) without training, on every rank of the pipeline.

        The whole batch goes through the virtual stages in order, without
        dropout: each stage's rank runs it and sends the hidden states to
        the next one's (one alltoall per change of rank); the last stage's
        loss is then summed over the pipeline, to which only it adds.
        """
        inputs, targets, weights, segment_ids = _fields(batch)
        rank, last = self.stage.rank, self.stage.last
        x = inputs
        for virtual_stage in range(last):  # each stage before the last, then its hop
            owner, receiver = (self.schedule.rank_of(virtual_stage),
                               self.schedule.rank_of(virtual_stage + 1))
            if owner == rank:
                x = self._evaluations[virtual_stage](x, None, None, segment_ids)
            if receiver != owner:
                splits = [0] * self.schedule.stages
                if rank == owner:
                    splits[receiver] = inputs.shape[0]
                x = self._send(x if rank == owner else self._empty(inputs.shape[1]), splits,
                               f"pipeline_evaluate_{virtual_stage}")
        loss = tf.constant(0.0)
        if self.schedule.rank_of(last) == rank:
            loss = self._evaluations[last](x, targets, weights, segment_ids)
        loss = self._hvd.allreduce(loss, op=self._hvd.Sum, name="pipeline_evaluate_loss",
                                   process_set=self.pipeline_set)
        return loss, {}

    def _update_fn(self, gradients, gradient_norm):
        return self._sharding.apply(gradients, _loss_scale(self.optimizer), norm=gradient_norm)

    def _sum_tied_table(self, gradients):
        """First and last stage add each other's token-table gradient (one alltoall)."""
        if not self.stage.trains_table:
            return gradients
        first, last = self.schedule.rank_of(0), self.schedule.rank_of(self.stage.last)
        rank = self.stage.rank
        table = self.stage.table
        splits = [0] * self.schedule.stages
        if rank in (first, last) and self._index.get(id(table)) is not None:
            position = self._index[id(table)]
            splits[last if rank == first else first] = table.shape[0]
            sent = gradients[position]
        else:
            position = None
            sent = tf.zeros([0, table.shape[1]], "float32")
        output, _ = self._hvd.alltoall(sent, splits=splits, name="pipeline_tied_table",
                                       process_set=self.pipeline_set)
        gradients = list(gradients)
        if position is not None:
            gradients[position] = gradients[position] + output  # (V, C)
        return gradients

    def _loss_and_norm(self, losses, gradients):
        """The batch's loss and the global gradient norm, each the same on every rank.

        Under tensor parallelism the squares of the slices (split
        variables) are summed over the tensor group too; the replicated
        variables, the same on every rank of the group, count once.
        """
        # The last stage's copy of a tied table has the first stage's gradient: count it once.
        duplicate = (self.stage.table if self.stage.trains_table and not self.stage.holds_first
                     else None)
        tensor_slice = self.stage.model.tensor_slice
        split = split_rules(self.stage.model)
        squares = {True: [], False: []}
        for variable, gradient in zip(self.variables, gradients):
            if variable is not duplicate:
                squares[id(variable) in split].append(
                    tf.reduce_sum(tf.square(tf.cast(gradient, "float32"))))
        squares = tf.stack([tf.add_n(squares[kind]) if squares[kind] else tf.constant(0.0)
                            for kind in (True, False)])
        if self.zero is not None:  # of shards: the stage's squares add up over its replicas
            squares = self.zero.sum_over_ranks(squares)
        local = tf.stack([
            squares[0],
            squares[1],
            tf.add_n(losses) if losses else tf.constant(0.0),
        ])
        total = self._hvd.allreduce(local, op=self._hvd.Sum, name="pipeline_loss_and_norm",
                                    process_set=self.pipeline_set)
        sliced = total[0]
        if tensor_slice.size > 1:
            sliced = self._hvd.allreduce(sliced, op=self._hvd.Sum, name="pipeline_sliced_norm",
                                         process_set=tensor_slice.process_set)
        return total[2], tf.sqrt(sliced + total[1])


def _fields(batch):
    """`(inputs, targets, weights, segment_ids)` of a batch (see
    `PipelineTrainStep`), None for what it lacks."""
    return tuple(batch) + (None,) * (4 - len(batch))
