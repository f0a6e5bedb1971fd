"""Which rank does what: the data x pipeline x tensor layout of a run.

The layout is built once at start-up from the world size and the
parallel sizes; everything else asks it instead of recomputing from
`hvd.rank()`. Ranks are numbered with the tensor coordinate innermost,
then the pipeline stage, then the data-parallel replica:

    rank = (data_index * pipeline + stage) * tensor + tensor_index

so a tensor group is consecutive ranks (one node, the fastest links), a
pipeline group strides by `tensor`, and a data-parallel group by
`pipeline * tensor` (Megatron-LM's order, Narayanan et al. 2021 section 3).
Importing this module does not import TensorFlow.
"""

from tfgpt.config.checks import require_positive_int


class ParallelLayout:
    """The sizes of each kind of parallelism and this rank's place in them.

    Args:
        world_size: int. Processes in the run (N).
        rank: int. This process's rank.
        pipeline: int. Pipeline stages (P, `--pipeline-parallel`).
        tensor: int. Tensor-parallel ranks per stage (T).

    The data-parallel size D is N / (P x T); a world size that P x T does
    not divide is refused (D x T x P must be N).

    Example:
    >>> layout = ParallelLayout(world_size=8, rank=5, pipeline=2, tensor=2)
    >>> layout.data, layout.coordinates(5)
    (2, (1, 0, 1))
    >>> layout.pipeline_group(5), layout.data_group(5)
    ([5, 7], [1, 5])
    """

    def __init__(self, world_size, rank=0, pipeline=1, tensor=1):
        require_positive_int("world_size", world_size)
        require_positive_int("pipeline_parallel", pipeline)
        require_positive_int("tensor_parallel", tensor)
        if world_size % (pipeline * tensor):
            raise ValueError(
                "--pipeline-parallel x --tensor-parallel must divide the number of workers "
                "(data x tensor x pipeline = workers). Received: "
                f"pipeline_parallel={pipeline}, tensor_parallel={tensor}, workers={world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` must be in [0, {world_size}). Received: rank={rank}")
        self.world_size = world_size
        self.rank = rank
        self.pipeline = pipeline
        self.tensor = tensor
        self.data = world_size // (pipeline * tensor)
        self.data_index, self.stage, self.tensor_index = self.coordinates(rank)

    def coordinates(self, rank):
        """`(data_index, stage, tensor_index)` of `rank`."""
        return rank // (self.pipeline * self.tensor), (rank // self.tensor) % self.pipeline, (
            rank % self.tensor
        )

    def rank_of(self, data_index, stage, tensor_index=0):
        return (data_index * self.pipeline + stage) * self.tensor + tensor_index

    def pipeline_group(self, rank=None):
        """The ranks of `rank`'s pipeline (this rank's by default), stage 0 first."""
        data_index, _, tensor_index = self.coordinates(self.rank if rank is None else rank)
        return [self.rank_of(data_index, stage, tensor_index) for stage in range(self.pipeline)]

    def data_group(self, rank=None):
        """The ranks holding the same stage and tensor slice as `rank`, replica 0 first."""
        _, stage, tensor_index = self.coordinates(self.rank if rank is None else rank)
        return [self.rank_of(index, stage, tensor_index) for index in range(self.data)]

    def pipeline_groups(self):
        """Every pipeline group (each rank in one)."""
        return [self.pipeline_group(self.rank_of(d, 0, t))
                for d in range(self.data) for t in range(self.tensor)]

    def data_groups(self):
        """Every data-parallel group (each rank in one)."""
        return [self.data_group(self.rank_of(0, s, t))
                for s in range(self.pipeline) for t in range(self.tensor)]

    def __repr__(self):
        return (f"ParallelLayout(data={self.data}, pipeline={self.pipeline}, "
                f"tensor={self.tensor}, rank={self.rank})")
