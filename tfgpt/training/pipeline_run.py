"""What a pipeline-parallel pretraining run adds to the trainer core.

`train_hvd.py --pipeline-parallel P` runs `tfgpt.training.trainer.train`
as usual; these are the parts that differ: the refusals, checked before
the model is built; the stage and its step
(`tfgpt.distributed.pipeline_stage`, `pipeline_executor`); and the
checkpoints. A checkpoint is an ordinary one: before each save every
stage's weights (and dropout state) are broadcast from the rank that
trains them, so the chief writes the whole model, which `--resume`,
generation and fine-tuning read like any other; each rank writes its own
optimizer state beside it, in `OUT/pipeline/stage-S` (the first
data-parallel replica of each stage writes it; under `--zero-stage 1`
every rank writes its shards and their optimizer state, in
`OUT/pipeline/stage-S/replica-D-of-N`, and resumes on the same layout;
`stage_checkpointer`). With `--tensor-parallel` too, the model is written
in slices, and each stage's slice writes its optimizer state (under ZeRO,
each replica its shards) in a directory of its own
(`tfgpt.training.tensor_pipeline_checkpoint`).
`tfgpt.training.tensor_checkpoint` merges these into an ordinary
checkpoint and splits one into any pipeline layout.
"""

import os

import numpy as np

from tfgpt.distributed.pipeline_partition import check_partition
from tfgpt.training.checkpointing import Checkpointer, CheckpointerWrapper

PIPELINE_DIRECTORY = "pipeline"
# The options that decide which variables each stage trains, and so what
# its optimizer state holds (the schedule and --microbatches do not).
PIPELINE_CUT = ("pipeline_parallel", "virtual_stages", "pipeline_partition")


def stage_directory(directory, stage):
    """Where pipeline stage `stage` writes its optimizer state."""
    return os.path.join(directory, PIPELINE_DIRECTORY, f"stage-{stage}")


def replicas_written(directory, step):
    """Whether ZeRO replicas wrote their shards at `step` in `directory` (a
    stage's optimizer directory), as `stage_checkpointer` does under
    `--zero-stage 1`."""
    index = f"ckpt-{int(step)}.index"
    return os.path.isdir(directory) and any(
        name.startswith("replica-") and os.path.exists(os.path.join(directory, name, index))
        for name in os.listdir(directory))


def stage_count(directory, step):
    """P of the pipeline checkpoint at `step`, or None for one without stages
    (P x T with tensor parallelism too: each stage's slice has its directory)."""
    root = os.path.join(directory, PIPELINE_DIRECTORY)
    if not os.path.isdir(root):
        return None
    index = f"ckpt-{int(step)}.index"

    def written(stage):  # by its first replica, or (--zero-stage 1) by each replica
        return os.path.exists(os.path.join(stage, index)) or replicas_written(stage, step)

    count = sum(written(os.path.join(root, name)) for name in os.listdir(root)
                if name.startswith("stage-") and os.path.isdir(os.path.join(root, name)))
    return count or None


def stage_checkpointer(directory, config, layout, optimizer, zero=None):
    """The `Checkpointer` of this rank's optimizer state in `directory`.

    The first data replica writes it, every replica reads it; under
    `--zero-stage 1` (`zero`: the stage's `ZeroSharding`) every replica
    writes and reads its own shards and their optimizer state, in
    `directory/replica-D-of-N`.
    """
    if zero is None:
        return Checkpointer(directory, layout.data_index == 0, keep=config.keep_checkpoints,
                            optimizer=optimizer)
    return Checkpointer(
        os.path.join(directory, f"replica-{layout.data_index}-of-{layout.data}"), True,
        keep=config.keep_checkpoints, optimizer=optimizer,
        shards=[shard.value for shard in zero.shards],
    )


def check_pipeline_run(config, options, family, model_config):
    """Raises ValueError, naming the flags, for what a pipeline run does not do."""
    stages = options.pipeline_parallel
    flag = f"--pipeline-parallel {stages}"
    if family != "gpt":
        raise ValueError(f"{flag} cuts a GPT into stages; --preset {config.preset} is a "
                         f"{family} model")
    refusals = [
        (config.accumulation_steps > 1,
         f"--accumulation-steps {config.accumulation_steps}: the pipeline accumulates over "
         "--microbatches; raise --batch-size and --microbatches instead"),
        (config.xla, "--xla: the pipeline's steps run Horovod transfers between the stages' "
                     "passes, which XLA cannot compile"),
        (config.mixed_precision == "float16",
         "--mixed-precision float16: loss scaling across stages is not supported; use bfloat16"),
        (config.recompute, "--recompute: not supported with a pipeline yet"),
        (config.towers > 1, f"--towers {config.towers}: a pipeline stage runs one tower"),
    ]
    for refused, reason in refusals:
        if refused:
            raise ValueError(f"{flag} cannot be combined with {reason}")
    if config.batch_size % options.microbatches:
        raise ValueError(
            "`batch_size` must be divisible by `microbatches` (each micro-batch is "
            f"batch_size / microbatches sequences). Received: batch_size={config.batch_size}, "
            f"microbatches={options.microbatches}"
        )
    check_partition(model_config.num_layers, stages * options.virtual_stages)


def build_pipeline(model, optimizer, distribution, sequence_length):
    """`(stage, train_step)` of this rank; builds `optimizer` on the stage's variables.

    With `--zero-stage 1` the optimizer is built on this rank's shards of
    them, cut over the stage's data replicas (`train_step.zero`).
    """
    from tfgpt.distributed.pipeline_executor import PipelineTrainStep
    from tfgpt.distributed.pipeline_schedule import PipelineSchedule
    from tfgpt.distributed.pipeline_stage import PipelineStage

    options = distribution.options
    schedule = PipelineSchedule(options.pipeline_schedule, options.pipeline_parallel,
                                options.microbatches, options.virtual_stages)
    stage = PipelineStage(model, schedule, distribution.layout.stage,
                          partition=options.pipeline_partition, sequence_length=sequence_length)
    zero = None
    if getattr(distribution, "zero_stage", 0):
        from tfgpt.distributed.zero import ZeroSharding

        zero = ZeroSharding(distribution.zero_stage, model, optimizer, distribution,
                            variables=stage.trainable_variables)
    else:
        optimizer.build(stage.trainable_variables)
    return stage, PipelineTrainStep(stage, optimizer, distribution.pipeline_process_set,
                                    distribution.data_process_set, zero=zero)


def describe(stage, layout=None, zero_stage=0):
    """The start-up line: the schedule, its bubble, which blocks each stage
    runs, and what this rank trains; with the run's `layout`, for each rank
    of the first data replica, its blocks, its tensor slice and its bytes
    (under `zero_stage` 1, with its shard of its stage's moments)."""
    schedule = stage.schedule
    trained = sum(int(np.prod(v.shape)) for v in stage.trainable_variables)
    line = (
        f"pipeline: {schedule.name}, {schedule.stages} stages x {schedule.virtual_stages} "
        f"chunk(s), {schedule.microbatches} micro-batches, {schedule.ticks} ticks per step, "
        f"bubble {schedule.bubble(0):.3f} (idle / busy ticks); {stage.describe()}; rank "
        f"{stage.rank} trains {trained:,} parameters (their gradients and"
        f"{' its shard of their' if zero_stage else ''} optimizer state; every rank keeps the "
        "whole model's weights)"
    )
    if layout is not None:
        line += "; per rank: " + "; ".join(
            _rank_state(stage, layout, rank, zero_stage)
            for rank in range(layout.size // layout.data))
    return line


def _rank_state(stage, layout, rank, zero_stage=0):
    """`rank`'s blocks, slice and float32 bytes of weights (every rank holds
    its slice of all of them, and under ZeRO a float32 copy of its shards),
    gradients and AdamW moments (its stage's, or under ZeRO its shard of
    them over the data replicas: `tfgpt.distributed.zero.state_bytes`)."""
    from tfgpt.distributed.zero import state_bytes
    from tfgpt.training.loop import byte_size

    _, pipeline_index, tensor_index = layout.coordinates(rank)
    schedule = stage.schedule
    chunks = [schedule.virtual_stage(pipeline_index, chunk)
              for chunk in range(schedule.virtual_stages)]
    # A slice's sizes are the same on every rank of its tensor group.
    trained = {id(v): int(np.prod(v.shape)) for chunk in chunks
               for v in stage.chunk_variables(chunk)}
    sizes = state_bytes(sum(trained.values()), zero_stage, layout.data)
    held = sum(int(np.prod(v.shape)) for v in stage.model.trainable_variables)
    # The weights it holds, plus (ZeRO) the shards' copy beside the trained ones.
    weights = 4 * held + sizes["parameters"] - 4 * sum(trained.values())
    blocks = ", ".join(f"{stage.ranges[chunk][0]}-{stage.ranges[chunk][1] - 1}"
                       for chunk in chunks)
    return (
        f"rank {rank}: stage {pipeline_index} blocks {blocks}"
        + (f", tensor slice {tensor_index + 1}/{layout.tensor}" if layout.tensor > 1 else "")
        + f", trains {sum(trained.values()):,} of the {held:,} parameters it holds: parameters "
        f"{byte_size(weights)}, gradients {byte_size(sizes['gradients'])}, optimizer "
        f"{byte_size(sizes['optimizer'])}"
    )


class PipelineCheckpointer(CheckpointerWrapper):
    """The chief writes the whole model, step and dropout state; each stage its optimizer.

    Args:
        config: the run config (`out`, `keep_checkpoints`).
        distribution: the run's `HorovodDistribution`.
        stage: this rank's `PipelineStage`.
        optimizer, step, rng: the optimizer, the step variable and the
            dropout random states (`tfgpt.training.loop`).
        zero: the stage's `ZeroSharding`, or None.
    """

    def __init__(self, config, distribution, stage, optimizer, step, rng, zero=None):
        super().__init__(Checkpointer(config.out, distribution.is_chief,
                                      keep=config.keep_checkpoints, model=stage.model, step=step,
                                      rng=rng), distribution)
        self.stage = stage
        layout = distribution.layout
        self.own = stage_checkpointer(stage_directory(config.out, layout.stage), config, layout,
                                      optimizer, zero)

    def save(self, step):
        # Every rank takes part in the broadcasts; the chief then holds the whole model.
        self.stage.broadcast_from_owners(self.distribution.broadcast_from_stage)
        self.own.save(step)
        self.barrier()  # every stage's state on disk
        return self.checkpointer.save(step)

    def restore_latest(self):
        """Restores the newest checkpoint, which must be cut as this run; returns its path."""
        from tfgpt.training.tensor_checkpoint import check_pipeline_cut, step_of

        path = self.latest
        if not path:
            return None
        step = step_of(path)
        check_pipeline_cut(self.directory, path, self.distribution.options)
        self.checkpointer.checkpoint.restore(path).assert_existing_objects_matched()
        own = os.path.join(self.own.directory, f"ckpt-{step}")
        if not os.path.exists(own + ".index"):
            raise ValueError(
                f"{path} has no optimizer state for pipeline stage {self.distribution.layout.stage}"
                f" ({own}): resume with the --pipeline-parallel, schedule and --zero-stage it was "
                "saved with"
            )
        self.own.checkpoint.restore(own).assert_existing_objects_matched()
        return path
