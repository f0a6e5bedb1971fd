"""Checkpoints of a run with both tensor and pipeline parallelism.

A `--tensor-parallel T --pipeline-parallel P` checkpoint at step S is, in
the run directory:

- `tensor/ckpt-S/slice-I-of-T.*`: slice I of the whole model (every
  stage's blocks, broadcast from the ranks that train them first, as a
  pipeline's whole checkpoint is) and its dropout states, written by the
  first stage's rank of slice I in the first data replica
  (`tfgpt.training.tensor_checkpoint`'s slice files, without an optimizer);
- `pipeline/stage-P-slice-I-of-T/ckpt-S.*`: the optimizer state of stage
  P's slice I (its moments are the slice's), written by that rank of the
  first data replica; under `--zero-stage 1` each data replica D of N
  writes its shards of it and their optimizer state instead, in
  `pipeline/stage-P-slice-I-of-T/replica-D-of-N/`
  (`tfgpt.training.pipeline_run.stage_checkpointer`), which resumes on
  the same layout only;
- `ckpt-S.*`, the chief's, with the step, last: its index names `ckpt-S`
  once every file is on disk.

`merge` (`python -m tfgpt.training.tensor_checkpoint merge RUN OUT`) joins
the slices into the checkpoint of a pipeline run with the same P and no
tensor parallelism: the whole model, step and dropout states in
`OUT/ckpt-S`, read as any whole model (generate, export, convert), and
each stage's optimizer state in `OUT/pipeline/stage-P` (ZeRO-1 shards
joined, `tfgpt.training.tensor_checkpoint.join_zero_replicas`), so that
OUT resumes with `--pipeline-parallel P`. `split RUN OUT --tensor-parallel
T --pipeline-parallel P` writes these files from an ordinary checkpoint
(`tfgpt.training.tensor_checkpoint.split`).
"""

import os

import tensorflow as tf

from tfgpt.distributed.tensor_parallel import TensorSlice, join_slices, slice_scope, split_rules
from tfgpt.distributed.zero import slot_variables
from tfgpt.training.checkpointing import Checkpointer, CheckpointerWrapper
from tfgpt.training.pipeline_run import replicas_written, stage_checkpointer
from tfgpt.training.tensor_checkpoint import (
    commit_slices, read_optimizer_state, slice_count, slice_prefix, step_of, zero_shards_error,
)


def optimizer_directory(directory, stage, index, size):
    """Where stage `stage`'s slice `index` of `size` writes its optimizer state."""
    return os.path.join(directory, "pipeline", f"stage-{stage}-slice-{index:03d}-of-{size:03d}")


class TensorPipelineCheckpointer(CheckpointerWrapper):
    """Slices of the whole model, each stage's slice of the optimizer, the chief's index last.

    Args:
        config: the run config (`out`, `keep_checkpoints`).
        distribution: the run's `HorovodDistribution` (with a `tensor_slice`).
        stage: this rank's `PipelineStage`.
        optimizer, step, rng: the optimizer, the step variable and the
            dropout random states (`tfgpt.training.loop`).
        zero: the stage's `ZeroSharding` (`--zero-stage 1`), or None.
    """

    def __init__(self, config, distribution, stage, optimizer, step, rng, zero=None):
        super().__init__(Checkpointer(config.out, distribution.is_chief,
                                      keep=config.keep_checkpoints, step=step), distribution)
        layout = distribution.layout
        self.stage = stage
        self.layout = layout
        self.zero = zero
        self.slice_checkpoint = tf.train.Checkpoint(model=stage.model, rng=rng)
        self.optimizer_directory = optimizer_directory(config.out, layout.stage,
                                                       layout.tensor_index, layout.tensor)
        self.own = stage_checkpointer(self.optimizer_directory, config, layout, optimizer, zero)

    def save(self, step):
        # Every rank takes part in the broadcasts; each then holds its slice of the whole model.
        self.stage.broadcast_from_owners(self.distribution.broadcast_from_stage)
        layout = self.layout
        if layout.data_index == 0 and layout.stage == 0:
            self.slice_checkpoint.write(
                slice_prefix(self.directory, step, layout.tensor_index, layout.tensor))
        self.own.save(step)
        return commit_slices(self, step)

    def restore_latest(self):
        """Restores the newest checkpoint, which must have this run's layout; returns its path."""
        path = self.latest
        if not path:
            return None
        step = step_of(path)
        layout = self.layout
        own = os.path.join(self.own.directory, f"ckpt-{step}")
        saved = slice_count(self.directory, step) == layout.tensor
        if saved and not os.path.exists(own + ".index"):
            if self.zero is not None:
                raise ValueError(
                    f"{path} has no ZeRO shards for this rank ({own}): resume with the "
                    "--zero-stage, --tensor-parallel, --pipeline-parallel and number of workers "
                    "it was saved with"
                )
            if replicas_written(self.optimizer_directory, step):
                raise zero_shards_error(path)
        if not saved or not os.path.exists(own + ".index"):
            raise ValueError(
                f"{path} was not written by --tensor-parallel {layout.tensor} "
                f"--pipeline-parallel {layout.pipeline} (no {own}): resume with the layout and "
                "schedule it was saved with"
            )
        self.checkpointer.checkpoint.restore(path).assert_existing_objects_matched()
        self.slice_checkpoint.read(
            slice_prefix(self.directory, step, layout.tensor_index, layout.tensor)
        ).assert_existing_objects_matched()
        self.own.checkpoint.restore(own).assert_existing_objects_matched()
        return path


# ---- Merging (one process, no Horovod) ------------------------------------------------


def _stage_optimizer(train_config, variables):
    from tfgpt.training.optimizers import make_optimizer

    optimizer = make_optimizer(train_config, 1)
    optimizer.build(variables)
    return optimizer


def slice_models(directory, step, size, family, model_config):
    """The `size` slice models of `directory`'s checkpoint at `step`, with their dropout states."""
    from tfgpt.training.loop import seed_generator_states
    from tfgpt.training.objectives import build_model

    models = []
    for index in range(size):
        with slice_scope(TensorSlice(None, None, size, index)):
            model = build_model(family, model_config, dtype="float32")
        tf.train.Checkpoint(model=model, rng=seed_generator_states(model)).read(
            slice_prefix(directory, step, index, size)).assert_existing_objects_matched()
        models.append(model)
    return models


def merge(directory, out, record, family, model_config, train_config):
    """Writes `directory`'s latest checkpoint as that of a `--pipeline-parallel P` run in `out`.

    `record`, `family`, `model_config`, `train_config`: the run's
    (`tfgpt.training.tensor_checkpoint._run_configs`). Returns the path of
    the whole model's checkpoint.
    """
    from tfgpt.distributed.pipeline_schedule import PipelineSchedule
    from tfgpt.distributed.pipeline_stage import PipelineStage
    from tfgpt.training.loop import seed_generator_states
    from tfgpt.training.objectives import build_model

    train = record["train"]
    path = tf.train.latest_checkpoint(directory)
    step = step_of(path)
    size = slice_count(directory, step)
    schedule = PipelineSchedule(train["pipeline_schedule"], train["pipeline_parallel"],
                                train["microbatches"], train["virtual_stages"])

    def stage_of(model, rank):
        return PipelineStage(model, schedule, rank, partition=train["pipeline_partition"],
                             sequence_length=record["data"]["seq_len"])

    slices = slice_models(directory, step, size, family, model_config)
    rules = split_rules(slices[0])
    model = build_model(family, model_config, dtype="float32")

    def join(variables):
        """Assigns to `variables` (a whole model's) the join of `[slice's variables]`."""
        for whole, parts, rule in variables:
            values = [part.numpy() for part in parts]
            whole.assign(values[0] if rule is None else join_slices(values, rule))

    # Slice 0's dropout states are the whole model's (the others' split
    # dropouts are offset from them).
    join([(v, parts, rules.get(id(parts[0]))) for v, *parts in zip(
        model.trainable_variables, *[m.trainable_variables for m in slices])])
    for whole, first in zip(seed_generator_states(model), seed_generator_states(slices[0])):
        whole.assign(first)
    step_variable = tf.Variable(step, dtype=tf.int64)
    for rank in range(schedule.stages):
        variables = stage_of(model, rank).trainable_variables
        optimizer = _stage_optimizer(train_config, variables)
        parts = []
        for index, part in enumerate(slices):
            trained = stage_of(part, rank).trainable_variables
            part_optimizer = _stage_optimizer(train_config, trained)
            read_optimizer_state(optimizer_directory(directory, rank, index, size), step,
                                 part_optimizer, trained, train_config)
            parts.append(part_optimizer)
        part_variables = stage_of(slices[0], rank).trainable_variables
        for name, moments in slot_variables(optimizer).items():
            join([(m, [slot_variables(p)[name][i] for p in parts],
                   rules.get(id(part_variables[i]))) for i, m in enumerate(moments)])
        in_slots = {id(m) for moments in slot_variables(optimizer).values() for m in moments}
        others = [v for v in optimizer.variables if id(v) not in in_slots]
        part_in_slots = {id(m) for moments in slot_variables(parts[0]).values() for m in moments}
        join([(v, [p], None) for v, p in zip(
            others, [v for v in parts[0].variables if id(v) not in part_in_slots])])
        Checkpointer(os.path.join(out, "pipeline", f"stage-{rank}"), True,
                     optimizer=optimizer).save(step)
    return Checkpointer(out, True, model=model, step=step_variable,
                        rng=seed_generator_states(model)).save(step)
