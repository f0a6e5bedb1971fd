"""What a pipeline-parallel pretraining run adds to the trainer core.

`train_hvd.py --pipeline-parallel P` runs `tfgpt.training.trainer.train`
as usual; these are the parts that differ: the refusals, checked before
the model is built, and the stage and its step
(`tfgpt.parallel.pipeline_stage`, `pipeline_executor`). Each stage
saves the weights and optimizer state it trains in the run's one
checkpoint format (`tfgpt.checkpoint`), which any layout resumes. Under
`--lora-rank` each stage trains the adapters of its own blocks, and its
checkpoints hold them alone, as any adapter run's do
(`tfgpt.checkpoint.base`); `--task sft`'s weighted loss is the global
batch's (`PipelineTrainStep`).
"""

import numpy as np

from tfgpt.cli import byte_size
from tfgpt.parallel.pipeline_executor import PipelineTrainStep
from tfgpt.parallel.pipeline_partition import check_partition
from tfgpt.parallel.pipeline_schedule import PipelineSchedule
from tfgpt.parallel.pipeline_stage import PipelineStage
from tfgpt.parallel.unallocated import build_unallocated
from tfgpt.parallel.zero import state_bytes
from tfgpt.training.loop import RunPart


def check_pipeline_sizes(config, options, model_config):
    """Raises ValueError, naming the flags, for sizes a pipeline cannot cut.

    (What it does not combine with: `tfgpt.parallel.refusals`.)
    """
    if config.batch_size % options.microbatches:
        raise ValueError(
            "`batch_size` must be divisible by `microbatches` (each micro-batch is "
            f"batch_size / microbatches sequences). Received: batch_size={config.batch_size}, "
            f"microbatches={options.microbatches}"
        )
    check_partition(model_config.num_layers, options.pipeline_parallel * options.virtual_stages)


class PipelinePart(RunPart):
    """A pipeline rank's part of the run (`tfgpt.training.loop.RunPart`):
    its stage, built from a whole model that holds no memory until the
    stage allocates its own variables, the optimizer on them (under
    `--zero-stage 1` on this rank's shards of them, cut over the stage's
    data replicas) and the pipelined step, which also validates."""

    @staticmethod
    def check(config, options, model_config):
        check_pipeline_sizes(config, options, model_config)

    @staticmethod
    def build_model(build_model):
        return build_unallocated(build_model)

    def __init__(self, model, optimizer, step, distribution, sequence_length=None):
        options = distribution.options
        schedule = PipelineSchedule(options.pipeline_schedule, options.pipeline_parallel,
                                    options.microbatches, options.virtual_stages)
        self.stage = PipelineStage(model, schedule, distribution.state.stage,
                                   partition=options.pipeline_partition,
                                   sequence_length=sequence_length)
        super().__init__(model, optimizer, step, distribution)
        self.pipeline_step = PipelineTrainStep(
            self.stage, optimizer, distribution.pipeline_process_set,
            distribution.data_process_set, zero=self.sharding)

    @property
    def trained(self):
        return self.stage

    def train_step(self, **options):
        # (The step takes a weighted loss's token weights from the batch itself.)
        return self.pipeline_step

    def eval_step(self, loss_fn, xla=False):
        return self.pipeline_step.evaluate

    def describe(self):
        return [describe(self.stage, self.distribution.state), *super().describe()]


def describe(stage, state=None):
    """The start-up line: the schedule, its bubble, which blocks each stage
    runs, and what this rank trains; with the run's parallel `state`, for
    each rank of the first data replica, its blocks, its tensor slice and
    its bytes (under ZeRO stage 1, with its shard of its stage's moments)."""
    zero_stage = state.zero_stage if state is not None else 0
    schedule = stage.schedule
    trained = sum(int(np.prod(v.shape)) for v in stage.trainable_variables)
    line = (
        f"pipeline: {schedule.name}, {schedule.stages} stages x {schedule.virtual_stages} "
        f"chunk(s), {schedule.microbatches} micro-batches, {schedule.ticks} ticks per step, "
        f"bubble {schedule.bubble(0):.3f} (idle / busy ticks); {stage.describe()}; rank "
        f"{stage.rank} holds and trains {trained:,} parameters (their gradients and"
        f"{' its shard of their' if zero_stage else ''} optimizer state)"
    )
    if state is not None:
        line += "; per rank: " + "; ".join(
            _rank_state(stage, state, rank) for rank in range(state.size // state.data))
    return line


def _rank_state(stage, state, rank):
    """`rank`'s blocks, slice and float32 bytes of weights (its stage's, and
    under ZeRO a float32 copy of its shards), gradients and AdamW moments
    (its stage's, or under ZeRO its shard of them over the data replicas:
    `tfgpt.parallel.zero.state_bytes`)."""
    _, pipeline_index, tensor_index = state.coordinates(rank)
    schedule = stage.schedule
    chunks = [schedule.virtual_stage(pipeline_index, chunk)
              for chunk in range(schedule.virtual_stages)]
    # A slice's sizes are the same on every rank of its tensor group.
    trained = {id(v): int(np.prod(v.shape)) for chunk in chunks
               for v in stage.chunk_variables(chunk)}
    held = sum(trained.values())
    sizes = state_bytes(held, state.zero_stage, state.data)
    blocks = ", ".join(f"{stage.ranges[chunk][0]}-{stage.ranges[chunk][1] - 1}"
                       for chunk in chunks)
    return (
        f"rank {rank}: stage {pipeline_index} blocks {blocks}"
        + (f", tensor slice {tensor_index + 1}/{state.tensor}" if state.tensor > 1 else "")
        + f", holds and trains {held:,} parameters: parameters "
        f"{byte_size(sizes['parameters'])}, gradients {byte_size(sizes['gradients'])}, optimizer "
        f"{byte_size(sizes['optimizer'])}"
    )
