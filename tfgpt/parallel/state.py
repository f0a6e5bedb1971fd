"""The parallel state of a run: which rank does what in data × pipeline × tensor, ZeRO's stage.

Every distribution has one (`distribution.state`; one process: all ones,
ZeRO stage 0): code asks it, not the distribution's class.

`N = data * pipeline * tensor` ranks, numbered with the tensor index
innermost, then the pipeline stage, then the data replica:

    rank = (data_index * pipeline + pipeline_index) * tensor + tensor_index

so a tensor group (the ranks that hold the slices of the same blocks and
exchange activations at every layer) is `tensor` consecutive ranks, the
ones most likely to share a machine. A data group is the ranks with the
same pipeline stage and tensor slice, one per data replica: the ranks that
average their gradients. Importing this module does not import TensorFlow
or Horovod; `ParallelState.process_sets` builds the Horovod process sets.
"""

import dataclasses

from tfgpt.config.checks import require_one_of, require_positive_int
from tfgpt.config.distribution import ZERO_STAGES


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """A run's parallel state: `size` ranks as data × pipeline × tensor, and ZeRO's stage.

    Args:
        size: int. Ranks in the run (`horovodrun -np N`).
        tensor: int. Ranks that split each block's heads, feed-forward width
            and vocabulary (`--tensor-parallel`).
        pipeline: int. Pipeline stages, each holding consecutive blocks
            (1: every rank holds every block).
        rank: int. This process's rank: the default of the methods that
            take one, and of `data_index`, `stage` and `tensor_index`.
        zero_stage: int. 0-3: which of the optimizer state, the gradients
            and the weights are sharded over the data group
            (`--zero-stage`, `tfgpt.parallel.zero`).

    The data-parallel size `data = size / (pipeline * tensor)` follows.

    Example:
    >>> state = ParallelState(size=4, tensor=2)
    >>> state.data, state.tensor_group(3), state.data_group(3)
    (2, [2, 3], [1, 3])
    >>> ParallelState(size=8, pipeline=2, tensor=2, rank=5).pipeline_group()
    [5, 7]
    >>> ParallelState(size=1).coordinates(), ParallelState(size=1).pipelined
    ((0, 0, 0), False)
    """

    size: int
    tensor: int = 1
    pipeline: int = 1
    rank: int = 0
    zero_stage: int = 0

    def __post_init__(self):
        require_positive_int("size", self.size)
        require_one_of("zero_stage", self.zero_stage, ZERO_STAGES)
        require_positive_int("tensor_parallel", self.tensor)
        require_positive_int("pipeline_parallel", self.pipeline)
        if self.size % (self.tensor * self.pipeline):
            raise ValueError(
                "The number of ranks must be data x pipeline x tensor: --tensor-parallel "
                f"{self.tensor} x --pipeline-parallel {self.pipeline} does not divide the {self.size} "
                f"rank(s) of horovodrun -np {self.size}. Received: size={self.size}, "
                f"tensor_parallel={self.tensor}, pipeline_parallel={self.pipeline}"
            )

    @property
    def data(self):
        """Data-parallel replicas: the ranks that read different batches."""
        return self.size // (self.tensor * self.pipeline)

    @property
    def split(self):
        """Whether the model is split across ranks (tensor or pipeline parallelism):
        not every rank holds all of it."""
        return self.tensor * self.pipeline > 1

    @property
    def pipelined(self):
        """Whether the model is cut into pipeline stages (`--pipeline-parallel` above 1)."""
        return self.pipeline > 1

    @property
    def data_index(self):
        """This rank's data replica."""
        return self.coordinates()[0]

    @property
    def stage(self):
        """This rank's pipeline stage."""
        return self.coordinates()[1]

    @property
    def tensor_index(self):
        """This rank's tensor slice."""
        return self.coordinates()[2]

    def coordinates(self, rank=None):
        """`(data_index, pipeline_index, tensor_index)` of `rank` (this rank by default)."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.size:
            raise ValueError(f"`rank` must be in [0, {self.size}). Received: rank={rank}")
        replica, tensor_index = divmod(rank, self.tensor)
        data_index, pipeline_index = divmod(replica, self.pipeline)
        return data_index, pipeline_index, tensor_index

    def rank_of(self, data_index, pipeline_index, tensor_index):
        """The rank at these coordinates."""
        return (data_index * self.pipeline + pipeline_index) * self.tensor + tensor_index

    def tensor_group(self, rank=None):
        """The ranks that hold the other slices of `rank`'s blocks, in slice order."""
        data_index, pipeline_index, _ = self.coordinates(rank)
        return [self.rank_of(data_index, pipeline_index, t) for t in range(self.tensor)]

    def pipeline_group(self, rank=None):
        """The ranks of `rank`'s pipeline (this rank's by default), stage 0 first."""
        data_index, _, tensor_index = self.coordinates(rank)
        return [self.rank_of(data_index, stage, tensor_index) for stage in range(self.pipeline)]

    def data_group(self, rank=None):
        """The ranks that hold what `rank` holds, one per data replica: they average gradients."""
        _, pipeline_index, tensor_index = self.coordinates(rank)
        return [self.rank_of(d, pipeline_index, tensor_index) for d in range(self.data)]

    def tensor_groups(self):
        """Every tensor group, by its first rank."""
        return [self.tensor_group(rank) for rank in range(0, self.size, self.tensor)]

    def pipeline_groups(self):
        """Every pipeline group, in the order of the rank of their first member."""
        return [self.pipeline_group(self.rank_of(d, 0, t))
                for d in range(self.data) for t in range(self.tensor)]

    def data_groups(self):
        """Every data group, in the order of the rank of their first member."""
        return [self.data_group(rank) for rank in range(self.pipeline * self.tensor)]

    def describe(self, rank=None):
        """The start-up line: the sizes and, for `rank` (or all), which slice it holds."""
        ranks = range(self.size) if rank is None else [rank]
        parts = []
        for each in ranks:
            data_index, pipeline_index, tensor_index = self.coordinates(each)
            parts.append(
                f"rank {each}: data replica {data_index}, "
                + (f"stage {pipeline_index}, " if self.pipeline > 1 else "")
                + f"tensor slice {tensor_index + 1}/{self.tensor}"
            )
        return (
            f"layout: {self.size} rank(s) = data {self.data} x pipeline {self.pipeline} x "
            f"tensor {self.tensor} (tensor groups {self.tensor_groups()}); " + "; ".join(parts)
        )

    def ranks_phrase(self, replicas):
        """The start-up lines' words for the ranks: `replicas` rank(s) (a
        `tf.distribute` strategy's replicas), or, with the model split, the
        data replicas times the split and which part this rank holds.

        >>> ParallelState(size=8, pipeline=2, tensor=2).ranks_phrase(2)
        "2 data replica(s) x pipeline 2 x tensor 2, this rank's stage's slice"
        """
        if not self.split:
            return f"{replicas} rank(s)"
        staged, sliced = self.pipelined, self.tensor > 1
        part = "stage's slice" if staged and sliced else "stage" if staged else "slice"
        return (f"{self.data} data replica(s)" + (f" x pipeline {self.pipeline}" if staged else "")
                + (f" x tensor {self.tensor}" if sliced else "") + f", this rank's {part}")

    def process_sets(self, hvd, rank=None):
        """`rank`'s Horovod process sets: `{"tensor": ..., "pipeline": ..., "data": ...}`.

        A group of one rank has None; a group of every rank is Horovod's
        global set. Every rank registers every group in the same order
        (Horovod's `add_process_set` is collective), which needs
        `HOROVOD_DYNAMIC_PROCESS_SETS=1` before `hvd.init()`.
        """
        sets = {tuple(range(self.size)): hvd.global_process_set}
        for group in self.tensor_groups() + self.pipeline_groups() + self.data_groups():
            if len(group) > 1 and tuple(group) not in sets:
                sets[tuple(group)] = hvd.add_process_set(group)
        return {kind: sets.get(tuple(group(rank))) for kind, group in (
            ("tensor", self.tensor_group), ("pipeline", self.pipeline_group),
            ("data", self.data_group))}
