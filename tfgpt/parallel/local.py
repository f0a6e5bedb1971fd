"""A single process on its default device: every collective is the identity."""

import contextlib

import tensorflow as tf

from tfgpt.parallel.state import ParallelState
from tfgpt.parallel.tensor_parallel import WHOLE


class LocalDistribution:
    """One worker, one replica; nothing to average or broadcast.

    The interface every distribution offers the trainer core:
    `rank`, `size` (replicas in sync), `is_chief`, `scope()`,
    `distribute_dataset(fn)`, `run(fn, batch)`, `allreduce_gradients`,
    `allreduce_mean`, `broadcast_variables`, `configure_optimizer`,
    `data_shard()`, `state` (the `tfgpt.parallel.state.ParallelState`:
    sizes, this rank's coordinates, ZeRO's stage), `tensor_slice` (this rank's
    `tfgpt.parallel.tensor_parallel.TensorSlice`, `WHOLE` without one) and
    `towers` (how many slices of each batch the step runs side by side).
    Front ends build theirs with `create(options, config)`.
    """

    rank = 0
    size = 1
    num_workers = 1
    local_rank = 0
    local_size = 1
    is_chief = True
    # Concurrent slices of each batch (tfgpt.parallel.cpu_threads).
    towers = 1
    # This rank's slice of the blocks under tensor parallelism.
    tensor_slice = WHOLE
    # One rank, the whole model, nothing sharded.
    state = ParallelState(size=1)
    # The front end's options (`tfgpt.config.distribution`) it was created
    # with; written into the run's config.json beside the run config.
    options = None

    def scope(self):
        return contextlib.nullcontext()

    def data_shard(self):
        """`(index, count)`: which of the `count` input pipelines this worker reads.

        One per worker, except under tensor or pipeline parallelism, where
        the ranks of a tensor group, and the stages of a pipeline, read the
        same batches.
        """
        return self.rank, self.num_workers

    def input_context(self):
        index, count = self.data_shard()
        return tf.distribute.InputContext(
            num_input_pipelines=count,
            input_pipeline_id=index,
            num_replicas_in_sync=self.size,
        )

    def distribute_dataset(self, dataset_fn):
        """Builds this worker's dataset from `dataset_fn(input_context)`."""
        return dataset_fn(self.input_context())

    def run(self, replica_fn, batch):
        return replica_fn(batch)

    def configure_optimizer(self, optimizer):
        return optimizer

    def one_batch_per_group(self, batches, every_step=False):
        """`batches`, as every rank that computes on one batch must see them
        (`HorovodDistribution`: a tensor group, a pipeline); here as they are."""
        del every_step
        return batches

    def allreduce_gradients(self, gradients):
        return gradients

    def replica_sum(self, value):
        return value

    def allreduce_mean(self, value):
        return value

    def broadcast_variables(self, variables):
        del variables


def device_settings(config=None):
    """What a distribution's `create` reads from a run config, as keyword arguments.

    Without a config: threads split as usual, one tower, batch size and
    XLA unknown.
    """
    if config is None:
        return dict(intra_op_threads=0, towers=1, batch_size=0, xla=False)
    return dict(
        intra_op_threads=config.intra_op_threads,
        towers=config.towers,
        batch_size=config.batch_size,
        xla=config.xla,
    )
