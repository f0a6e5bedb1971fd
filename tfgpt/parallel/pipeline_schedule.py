"""Pipeline schedules as data: each rank's ticks of forward and backward passes.

A pipeline of `stages` ranks trains on `microbatches` micro-batches per
step. Each rank holds `virtual_stages` contiguous chunks of the model
(1 except for the interleaved schedule); virtual stage `k = chunk *
stages + rank` runs on rank `k % stages`, so a micro-batch visits rank 0,
1, ..., stages - 1, then rank 0 again for its next chunk (Narayanan et
al. 2021, figure 4).

A schedule is first each rank's program, the order in which it runs its
operations (`Operation`: forward or backward of a micro-batch on one of
its chunks), then a timetable: time is cut into ticks, each rank runs at
most one operation per tick, and what a tick produces (an activation for
the next virtual stage, a gradient for the previous one) is exchanged
after it, so that it can be used from the next tick on. Each rank runs
its next operation at the first tick its inputs are there. Nothing in
this module imports TensorFlow; `tfgpt.parallel.pipeline_executor`
runs a timetable.

The three programs:

- `gpipe` (Huang et al. 2019): every forward pass, then every backward
  pass. Each rank holds the activations of all micro-batches at once.
- `1f1b` (PipeDream-Flush, Narayanan et al. 2021 figure 4 top): rank `r`
  runs `stages - r - 1` forward passes to fill the pipeline, then
  alternates one forward and one backward pass, then drains. At most
  `stages - r` micro-batches are in flight on rank `r`.
- `interleaved` (Narayanan et al. 2021 figure 4 bottom): 1F1B over
  `virtual_stages` chunks per rank, micro-batches taken in groups of
  `stages` through one chunk after the other. Needs `microbatches`
  divisible by `stages`.

With forward and backward passes of one tick each, the bubble (idle ticks
over busy ticks of a rank) is `(stages - 1) / microbatches` for `gpipe`
and `1f1b`, and `(stages - 1) / (virtual_stages * microbatches)` for
`interleaved`, whose ticks are chunks, `virtual_stages` times shorter:
`bubble()` reports it from the timetable and the tests check it against
these.

Example:
>>> print(PipelineSchedule("1f1b", stages=2, microbatches=3))
rank 0 | F0 F1 .  B0 F2 B1 .  B2
rank 1 | .  F0 B0 F1 B1 F2 B2 .
"""

import collections

from tfgpt.config.distribution import PIPELINE_SCHEDULES as SCHEDULES
from tfgpt.config.distribution import check_pipeline_schedule

__all__ = ["SCHEDULES", "PipelineSchedule"]

FORWARD, BACKWARD = "forward", "backward"

# One operation of a rank: the forward or backward pass of one micro-batch
# through one of the rank's chunks (0 to virtual_stages - 1).
Operation = collections.namedtuple("Operation", "kind microbatch chunk")

# One tensor sent after a tick: from `source` to `destination` rank, the
# activation (`kind` FORWARD) or gradient (BACKWARD) of `microbatch` at the
# input of `virtual_stage`, which runs on `destination`.
Transfer = collections.namedtuple(
    "Transfer", "source destination kind microbatch virtual_stage"
)


def _gpipe_program(rank, stages, microbatches):
    del rank, stages
    return ([Operation(FORWARD, index, 0) for index in range(microbatches)]
            + [Operation(BACKWARD, index, 0) for index in range(microbatches)])


def _one_forward_one_backward(forwards, backwards, warmup):
    """`warmup` forwards, then alternating forward and backward, then the rest."""
    program = list(forwards[:warmup])
    for index in range(len(forwards) - warmup):
        program += [forwards[warmup + index], backwards[index]]
    return program + list(backwards[len(forwards) - warmup:])


def _one_f_one_b_program(rank, stages, microbatches):
    forwards = [Operation(FORWARD, index, 0) for index in range(microbatches)]
    backwards = [Operation(BACKWARD, index, 0) for index in range(microbatches)]
    return _one_forward_one_backward(forwards, backwards, min(stages - rank - 1, microbatches))


def _interleaved_program(rank, stages, microbatches, virtual_stages):
    # Megatron-LM's order: micro-batches in groups of `stages`, each group
    # through chunk 0, 1, ... forward and through the last chunk first
    # backward; the warm-up fills every chunk of the ranks after this one.
    count = microbatches * virtual_stages

    def microbatch(index):
        return (index // (stages * virtual_stages)) * stages + index % stages

    def chunk(index):
        return (index // stages) % virtual_stages

    forwards = [Operation(FORWARD, microbatch(i), chunk(i)) for i in range(count)]
    backwards = [
        Operation(BACKWARD, microbatch(i), virtual_stages - 1 - chunk(i)) for i in range(count)
    ]
    warmup = min((stages - rank - 1) * 2 + (virtual_stages - 1) * stages, count)
    return _one_forward_one_backward(forwards, backwards, warmup)


class PipelineSchedule:
    """Each rank's program and the timetable of ticks it runs in.

    Args:
        name: str. `gpipe`, `1f1b` or `interleaved`.
        stages: int. Ranks in the pipeline (`--pipeline-parallel`).
        microbatches: int. Micro-batches per step (`--microbatches`).
        virtual_stages: int. Chunks per rank (`--virtual-stages`; above 1
            for `interleaved` only).

    Attributes:
        programs: per rank, its list of `Operation`s in the order it runs them.
        timetable: per rank, one entry per tick: the `Operation` it runs
            then, or None when it idles.
        transfers: per tick, the `Transfer`s exchanged after it.

    Raises ValueError (naming the flags) when the arguments do not fit
    together, and RuntimeError if a program could deadlock (a bug: the
    tests run every schedule over a range of sizes).
    """

    def __init__(self, name, stages, microbatches, virtual_stages=1):
        check_pipeline_schedule(name, stages, microbatches, virtual_stages)
        self.name = name
        self.stages = stages
        self.microbatches = microbatches
        self.virtual_stages = virtual_stages
        self.programs = [self._program(rank) for rank in range(stages)]
        self.timetable, self.transfers = self._simulate()

    @property
    def num_virtual_stages(self):
        return self.stages * self.virtual_stages

    def virtual_stage(self, rank, chunk):
        """The model chunk `chunk` of `rank`, as a position in the pipeline."""
        return chunk * self.stages + rank

    def rank_of(self, virtual_stage):
        return virtual_stage % self.stages

    def chunk_of(self, virtual_stage):
        return virtual_stage // self.stages

    def _program(self, rank):
        if self.name == "gpipe":
            return _gpipe_program(rank, self.stages, self.microbatches)
        if self.name == "1f1b":
            return _one_f_one_b_program(rank, self.stages, self.microbatches)
        return _interleaved_program(rank, self.stages, self.microbatches, self.virtual_stages)

    def _inputs_ready(self, rank, operation, done):
        """Whether what `operation` needs from other virtual stages was sent before."""
        stage = self.virtual_stage(rank, operation.chunk)
        if operation.kind == FORWARD:
            return stage == 0 or (FORWARD, operation.microbatch, stage - 1) in done
        own_forward = (FORWARD, operation.microbatch, stage) in done
        return own_forward and (
            stage == self.num_virtual_stages - 1
            or (BACKWARD, operation.microbatch, stage + 1) in done
        )

    def _simulate(self):
        positions = [0] * self.stages
        done = set()  # (kind, microbatch, virtual stage) finished at an earlier tick
        timetable = [[] for _ in range(self.stages)]
        transfers = []
        while any(position < len(program) for position, program in zip(positions, self.programs)):
            finished, sent = [], []
            for rank, program in enumerate(self.programs):
                operation = program[positions[rank]] if positions[rank] < len(program) else None
                if operation is None or not self._inputs_ready(rank, operation, done):
                    timetable[rank].append(None)
                    continue
                timetable[rank].append(operation)
                positions[rank] += 1
                stage = self.virtual_stage(rank, operation.chunk)
                finished.append((operation.kind, operation.microbatch, stage))
                target = stage + 1 if operation.kind == FORWARD else stage - 1
                if 0 <= target < self.num_virtual_stages:
                    sent.append(Transfer(rank, self.rank_of(target), operation.kind,
                                         operation.microbatch, target))
            if not finished:
                raise RuntimeError(
                    f"{self.name} schedule deadlocks with stages={self.stages}, "
                    f"microbatches={self.microbatches}, virtual_stages={self.virtual_stages}"
                )
            done.update(finished)
            transfers.append(sent)
        return timetable, transfers

    @property
    def ticks(self):
        return len(self.transfers)

    def busy_ticks(self, rank):
        return sum(operation is not None for operation in self.timetable[rank])

    def bubble(self, rank):
        """Idle ticks over busy ticks of `rank` (the pipeline bubble)."""
        busy = self.busy_ticks(rank)
        return (self.ticks - busy) / busy

    def theoretical_bubble(self):
        """`(stages - 1) / microbatches`, divided by `virtual_stages` for interleaved."""
        return (self.stages - 1) / (self.microbatches * self.virtual_stages)

    def in_flight(self, rank):
        """The most micro-batches whose activations `rank` holds at once: chunks
        forwarded and not yet backwarded, counted in whole micro-batches
        (a chunk is 1 / virtual_stages of the rank's layers)."""
        held, peak = 0, 0
        for operation in self.timetable[rank]:
            if operation is not None:
                held += 1 if operation.kind == FORWARD else -1
                peak = max(peak, held)
        return peak / self.virtual_stages

    def __str__(self):
        def cell(operation):
            if operation is None:
                return "."
            text = f"{operation.kind[0].upper()}{operation.microbatch}"
            return text + (f"/{operation.chunk}" if self.virtual_stages > 1 else "")

        cells = [[cell(operation) for operation in row] for row in self.timetable]
        width = max(len(text) for row in cells for text in row)
        return "\n".join(
            f"rank {rank} | " + " ".join(text.ljust(width) for text in row).rstrip()
            for rank, row in enumerate(cells)
        )
