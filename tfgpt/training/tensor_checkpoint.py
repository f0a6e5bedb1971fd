"""Tensor- and pipeline-parallel checkpoints: merged into and split from whole ones.

A checkpoint of a `--tensor-parallel T` run at step S is, in the run
directory:

- `tensor/ckpt-S/slice-I-of-T.*`, one per slice, written by the ranks of
  the first data replica: a `tf.train.Checkpoint` of the slice's model,
  optimizer (its moments are the slice's) and dropout states;
- under `--zero-stage 1`, the slices hold no optimizer: every rank
  writes its shards and their optimizer state in
  `tensor/ckpt-S/slice-I-of-T-replica-D-of-N.*` (replica D's rows of the
  slice's variables, `tfgpt.distributed.zero.shard_rows`), read back on
  the same layout, or joined by `merge`;
- `ckpt-S.*`, the chief's, with the step, through the same
  `CheckpointManager` as every run: its index names `ckpt-S` only once
  every slice is on disk, so a run killed mid-save resumes from the
  previous complete checkpoint.

A `--pipeline-parallel P` run's checkpoint is the chief's whole model,
step and dropout states in `ckpt-S.*`, and each stage's optimizer state
(the moments of the variables it trains) in `pipeline/stage-R/ckpt-S.*`,
or under `--zero-stage 1` each data replica's shards of it in
`pipeline/stage-R/replica-D-of-N/ckpt-S.*` (`tfgpt.training.pipeline_run`).
Which variables a stage trains follows from `PIPELINE_CUT` (P,
--virtual-stages, --pipeline-partition), read from the run's config.json.

`merge` turns such a directory, ZeRO-1 shards included (each slice's or
stage's moments are its replicas' rows joined in replica order,
`join_zero_replicas`), into an ordinary (single-worker) checkpoint, and
`split` an ordinary one into any T, any pipeline layout, or both (each
slice cut into the stages, as `tfgpt.training.tensor_pipeline_checkpoint`
reads it), so a model trained on one layout resumes or is fine-tuned on
another (merge, then split; what they write holds whole moments and
resumes with `--zero-stage 0`); `restore_whole` reads the slices
straight into a whole model (`tfgpt.loading`, so generate, export and
convert read tensor-parallel runs as they are).
Joining and cutting follow each variable's split rule
(`tfgpt.distributed.tensor_parallel.take_slice`); a stage's moments are
the whole optimizer's of its variables. A run with `--tensor-parallel`
and `--pipeline-parallel` (its slices here, each stage's slice's optimizer
state, or under `--zero-stage 1` its replicas' shards, beside the
stages') merges into a pipeline run's checkpoint
(`tfgpt.training.tensor_pipeline_checkpoint`), which merges again into an
ordinary one.

    python -m tfgpt.training.tensor_checkpoint merge RUN OUT
    python -m tfgpt.training.tensor_checkpoint split RUN OUT --tensor-parallel 2
    python -m tfgpt.training.tensor_checkpoint split RUN OUT --pipeline-parallel 2 \\
        --pipeline-schedule interleaved --virtual-stages 2 --microbatches 4
    python -m tfgpt.training.tensor_checkpoint split RUN OUT --tensor-parallel 2 \\
        --pipeline-parallel 2 --microbatches 2
"""

import argparse
import dataclasses
import os
import shutil

import tensorflow as tf

from tfgpt.cli import HelpFormatter
from tfgpt.config import FAMILIES
from tfgpt.config.distribution import HorovodOptions
from tfgpt.config.training import TrainConfig
from tfgpt.distributed.tensor_parallel import (
    TensorSlice, join_slices, slice_scope, split_rules, split_seed_states, take_slice,
)
from tfgpt.distributed.zero import shard_rows, slot_variables
from tfgpt.training.checkpointing import CONFIG_FILE, Checkpointer, CheckpointerWrapper
from tfgpt.training.checkpointing import read_config
from tfgpt.training.checkpointing import write_json_atomically
from tfgpt.training.pipeline_run import PIPELINE_CUT, stage_count, stage_directory

SLICES_DIRECTORY = "tensor"


def step_of(checkpoint_path):
    """The step number of a `.../ckpt-S` checkpoint prefix."""
    return int(checkpoint_path.rsplit("-", 1)[1])


def slices_directory(directory, step):
    return os.path.join(directory, SLICES_DIRECTORY, f"ckpt-{int(step)}")


def slice_prefix(directory, step, index, size):
    return os.path.join(slices_directory(directory, step), f"slice-{index:03d}-of-{size:03d}")


def slice_count(directory, step):
    """T of the tensor-parallel checkpoint at `step`, or None for a whole one."""
    root = slices_directory(directory, step)
    if not os.path.isdir(root):
        return None
    sizes = {int(name.split("-of-")[1].split(".")[0].split("-")[0])  # (a ZeRO rank's: -replica-)
             for name in os.listdir(root) if name.startswith("slice-")}
    return sizes.pop() if len(sizes) == 1 else None


def zero_written(directory, step):
    """Whether the tensor-parallel checkpoint at `step` holds ZeRO shards (and its
    slices no optimizer)."""
    return any("-replica-" in name for name in os.listdir(slices_directory(directory, step)))


def zero_shards_error(path):
    """The error for a ZeRO-1 checkpoint resumed without --zero-stage 1."""
    return ValueError(f"{path} was written with --zero-stage 1: its optimizer moments are "
                      "shards; resume it with --zero-stage 1 on the same layout")


def layout_error(path, found, wanted):
    """The error for a checkpoint of another layout than this run's.

    `found` and `wanted` are the layouts' flags ("" for a whole model).
    """
    if found and wanted:
        command = f"merge RUN MERGED, then split MERGED OUT {wanted}"
    else:
        command = f"split RUN OUT {wanted}" if wanted else "merge RUN OUT"
    return ValueError(
        f"{path} was written by {found or 'a whole model'}; this run is {wanted or 'whole'}: "
        f"convert it first with python -m tfgpt.training.tensor_checkpoint {command}"
    )


def split_elsewhere_error(path, found, wanted):
    """`layout_error` between tensor-parallel sizes (None or 1: whole)."""
    def flags(size):
        return f"--tensor-parallel {size}" if size not in (None, 1) else ""

    return layout_error(path, flags(found), flags(wanted))


def pipeline_cut(options):
    """`{option: value}` of `PIPELINE_CUT` in `options` (a `HorovodOptions` or a
    run record's `train`); None without a pipeline."""
    if isinstance(options, dict):  # HorovodOptions' defaults for a record without them
        defaults = {field.name: field.default for field in dataclasses.fields(HorovodOptions)}
        cut = {name: options.get(name, defaults[name]) for name in PIPELINE_CUT}
    else:
        cut = {name: getattr(options, name) for name in PIPELINE_CUT}
    return cut if cut["pipeline_parallel"] > 1 else None


def _cut_flags(cut):
    """The flags of a pipeline cut ("" for None)."""
    if cut is None:
        return ""
    return " ".join(f"--{name.replace('_', '-')} {cut[name]}" for name in PIPELINE_CUT)


def _saved_cut(directory, step):
    """The pipeline cut of `directory`'s checkpoint at `step`, or None."""
    if stage_count(directory, step) is None:
        return None
    return pipeline_cut(read_config(directory)["train"])


def check_whole(directory, path):
    """Raises `layout_error` unless `path` is an ordinary checkpoint (or a ZeRO one)."""
    slices = slice_count(directory, step_of(path))
    if slices is not None:
        raise split_elsewhere_error(path, slices, None)
    cut = _saved_cut(directory, step_of(path))
    if cut is not None:
        raise layout_error(path, _cut_flags(cut), "")


def check_pipeline_cut(directory, path, options):
    """Raises `layout_error` unless `path` was cut into stages as `options` cut this run."""
    step = step_of(path)
    slices = slice_count(directory, step)
    saved, wanted = _saved_cut(directory, step), pipeline_cut(options)
    if slices is not None or saved != wanted:
        found = f"--tensor-parallel {slices}" if slices is not None else _cut_flags(saved)
        raise layout_error(path, found, _cut_flags(wanted))


def _trackables(model, optimizer):
    from tfgpt.training.loop import seed_generator_states

    return dict(model=model, optimizer=optimizer, rng=seed_generator_states(model))


def commit_slices(wrapper, step):
    """Once every rank of `wrapper`'s run has written its parts of `step`:
    the chief's index names the step, then the slices of the steps it no
    longer keeps go. Returns the chief's path (None on other ranks)."""
    wrapper.barrier()  # every slice on disk
    checkpointer = wrapper.checkpointer
    path = checkpointer.save(step)
    if path:
        kept = {step_of(kept_path) for kept_path in checkpointer.manager.checkpoints}
        root = os.path.join(checkpointer.directory, SLICES_DIRECTORY)
        for name in os.listdir(root):
            if name.startswith("ckpt-") and int(name.split("-")[1]) not in kept:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return path


class TensorParallelCheckpointer(CheckpointerWrapper):
    """Saves and restores a tensor-parallel run: slices first, the chief's index last.

    Args:
        checkpointer: the chief's `Checkpointer` of the step.
        model, optimizer: this rank's slice of them.
        distribution: `HorovodDistribution` with a `tensor_slice`.
        zero: the run's `ZeroSharding` (`--zero-stage 1`), or None.
    """

    def __init__(self, checkpointer, model, optimizer, distribution, zero=None):
        super().__init__(checkpointer, distribution)
        self.tensor_slice = distribution.tensor_slice
        trackables = _trackables(model, optimizer)
        self.shard_checkpoint = None
        if zero is not None:
            del trackables["optimizer"]  # its moments are this rank's shards
            self.shard_checkpoint = tf.train.Checkpoint(
                optimizer=optimizer, shards=[shard.value for shard in zero.shards])
        self.slice_checkpoint = tf.train.Checkpoint(**trackables)

    def _shard_prefix(self, step, size):
        layout = self.distribution.layout
        return (slice_prefix(self.directory, step, self.tensor_slice.index, size)
                + f"-replica-{layout.data_index}-of-{layout.data}")

    def save(self, step):
        """Every slice of the first data replica writes its part; then the chief's index."""
        if self.distribution.data_shard()[0] == 0:
            self.slice_checkpoint.write(
                slice_prefix(self.directory, step, self.tensor_slice.index, self.tensor_slice.size)
            )
        if self.shard_checkpoint is not None:
            self.shard_checkpoint.write(self._shard_prefix(step, self.tensor_slice.size))
        return commit_slices(self, step)

    def restore_latest(self):
        """Restores the newest checkpoint, which must have this run's T; returns its path."""
        path = self.latest
        if not path:
            return None
        step = step_of(path)
        found = slice_count(self.directory, step)
        if found != self.tensor_slice.size:
            raise split_elsewhere_error(path, found, self.tensor_slice.size)
        if os.path.isdir(os.path.join(self.directory, "pipeline")):
            raise ValueError(
                f"{path} was written by a --pipeline-parallel run: resume with its "
                "--pipeline-parallel, or merge it first with python -m "
                "tfgpt.training.tensor_checkpoint merge RUN OUT")
        self.checkpointer.checkpoint.restore(path).assert_existing_objects_matched()
        if self.shard_checkpoint is None and zero_written(self.directory, step):
            raise zero_shards_error(path)
        prefix = slice_prefix(self.directory, step, self.tensor_slice.index, found)
        self.slice_checkpoint.read(prefix).assert_existing_objects_matched()
        if self.shard_checkpoint is not None:
            shards = self._shard_prefix(step, found)
            if not os.path.exists(shards + ".index"):
                raise ValueError(
                    f"{path} has no ZeRO shards for this rank ({shards}): resume with the "
                    "--zero-stage, --tensor-parallel and number of workers it was saved with"
                )
            self.shard_checkpoint.read(shards).assert_existing_objects_matched()
        return path


# ---- Merging and splitting (one process, no Horovod) ----------------------------------


def _run_configs(directory):
    record = read_config(directory)
    family = record["family"]
    model_config = FAMILIES[family].config_class(**record["model"])
    names = {field.name for field in dataclasses.fields(TrainConfig)}
    train_config = TrainConfig(**{k: v for k, v in record["train"].items() if k in names})
    return record, family, model_config, train_config


def _build(family, model_config, train_config, tensor_slice=None):
    """A model (a slice of it, with `tensor_slice`) and its built optimizer."""
    from tfgpt.training.objectives import build_model
    from tfgpt.training.optimizers import make_optimizer

    with slice_scope(tensor_slice):
        model = build_model(family, model_config, dtype="float32")
    optimizer = make_optimizer(train_config, 1)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _pairs(model, optimizer):
    """`[(variable, rule or None)]`: every variable a checkpoint holds, in a fixed order.

    The trainable variables, their optimizer moments (split like their
    variable), the optimizer's other variables and the dropout states.
    """
    from tfgpt.training.loop import seed_generator_states

    rules = split_rules(model)
    trainable = model.trainable_variables
    pairs = [(v, rules.get(id(v))) for v in trainable]
    slots = slot_variables(optimizer)
    for moments in slots.values():
        pairs += [(m, rules.get(id(v))) for m, v in zip(moments, trainable)]
    in_slots = {id(m) for moments in slots.values() for m in moments}
    pairs += [(v, None) for v in optimizer.variables if id(v) not in in_slots]
    pairs += [(v, None) for v in seed_generator_states(model)]
    return pairs


def _slices(directory, step, size, family, model_config, train_config, optimizer=True):
    """The `size` slice models and optimizers of `directory`'s checkpoint at `step`
    (without `optimizer`, the optimizers are not read; under ZeRO-1 each is
    joined from its data replicas' shards)."""
    zero = optimizer and zero_written(directory, step)
    built = []
    for index in range(size):
        model, slice_optimizer = _build(family, model_config, train_config,
                                        TensorSlice(None, None, size, index))
        trackables = _trackables(model, slice_optimizer)
        if not optimizer or zero:
            del trackables["optimizer"]
        prefix = slice_prefix(directory, step, index, size)
        tf.train.Checkpoint(**trackables).read(prefix).assert_existing_objects_matched()
        if zero:
            replicas = replica_count(slices_directory(directory, step),
                                     os.path.basename(prefix) + "-")
            join_zero_replicas([f"{prefix}-replica-{replica}-of-{replicas}"
                                for replica in range(replicas)],
                               slice_optimizer, model.trainable_variables, train_config)
        built.append((model, slice_optimizer))
    return built


def replica_count(directory, start):
    """N of the ZeRO-1 data replicas whose files (or directories) in
    `directory` are named `start` + `replica-D-of-N`; None without any."""
    counts = {int(name[len(start):].split("-of-")[1].split(".")[0])
              for name in os.listdir(directory) if name.startswith(start + "replica-")}
    if len(counts) > 1:
        raise ValueError(f"{directory} holds the ZeRO shards of {sorted(counts)} data replicas "
                         f"for {start or 'one stage'}: not one checkpoint's")
    return counts.pop() if counts else None


def join_zero_replicas(prefixes, optimizer, variables, train_config):
    """Gives `optimizer`, built on `variables` (a slice's or stage's), the
    state that its data replicas' ZeRO-1 checkpoints `prefixes` hold.

    Replica D's checkpoint (`optimizer`, `shards`) holds its rows of every
    variable of `variables`, in order (`tfgpt.distributed.zero.shard_rows`
    over the `len(prefixes)` replicas), and an optimizer built on them:
    each moment is its replicas' rows joined in replica order; the other
    optimizer variables (the step count, alike on all) are the first's.
    """
    import keras

    from tfgpt.training.optimizers import make_optimizer
    from tfgpt.training.sharded_checkpoint import replicated_optimizer_variables

    replicas = []
    for replica, prefix in enumerate(prefixes):
        if not os.path.exists(prefix + ".index"):
            raise ValueError(f"{prefix} is missing: the ZeRO-1 checkpoint of data replica "
                             f"{replica} of {len(prefixes)} was not written")
        shards = [keras.Variable(
            tf.zeros([shard_rows(v.shape[0], len(prefixes))[0][replica], *v.shape[1:]], v.dtype),
            trainable=True, name=v.name, dtype=v.dtype) for v in variables]
        shard_optimizer = make_optimizer(train_config, 1)
        shard_optimizer.build(shards)
        tf.train.Checkpoint(optimizer=shard_optimizer, shards=[s.value for s in shards]).read(
            prefix).assert_existing_objects_matched().expect_partial()  # a manager's save counter
        replicas.append(shard_optimizer)
    parts = [slot_variables(replica) for replica in replicas]
    for name, moments in slot_variables(optimizer).items():
        for index, moment in enumerate(moments):
            moment.assign(tf.concat([slots[name][index] for slots in parts], axis=0))
    for mine, theirs in zip(replicated_optimizer_variables(optimizer),
                            replicated_optimizer_variables(replicas[0])):
        mine.assign(theirs)


def read_optimizer_state(directory, step, optimizer, variables, train_config):
    """Reads into `optimizer` (built on `variables`) the state a pipeline
    stage's (or stage slice's) `directory` holds at `step`: its `ckpt-S`,
    or under ZeRO-1 its replicas' `replica-D-of-N/ckpt-S`, joined."""
    replicas = replica_count(directory, "") if os.path.isdir(directory) else None
    if replicas is None:
        tf.train.Checkpoint(optimizer=optimizer).read(
            os.path.join(directory, f"ckpt-{int(step)}")).assert_existing_objects_matched(
            ).expect_partial()  # the manager's save counter
        return
    join_zero_replicas([os.path.join(directory, f"replica-{replica}-of-{replicas}",
                                     f"ckpt-{int(step)}") for replica in range(replicas)],
                       optimizer, variables, train_config)


def _offset_seeds(model, tensor_slice):
    """Gives the split regions' dropouts of a slice `model` the slice's own streams."""
    for state in split_seed_states(model):
        tensor_slice.offset_seed(state)


def _join_into(whole_pairs, slice_pairs):
    """Assigns to the whole model's variables the join of their slices (rules: the slices')."""
    for position, (variable, _) in enumerate(whole_pairs):
        parts = [pairs[position][0].numpy() for pairs in slice_pairs]
        rule = slice_pairs[0][position][1]
        variable.assign(parts[0] if rule is None else join_slices(parts, rule))


def restore_whole(directory, path, model):
    """Reads the slices of the tensor-parallel checkpoint `path` into the whole `model`."""
    record, family, model_config, train_config = _run_configs(directory)
    step = step_of(path)
    size = slice_count(directory, step)
    if record["train"].get("pipeline_parallel", 1) > 1:  # slices of the model only
        from tfgpt.training.tensor_pipeline_checkpoint import slice_models

        models = slice_models(directory, step, size, family, model_config)
    else:
        models = [m for m, _ in _slices(directory, step, size, family, model_config,
                                        train_config, optimizer=False)]
    rules = split_rules(models[0])
    for index, variable in enumerate(model.trainable_variables):
        parts = [m.trainable_variables[index].numpy() for m in models]
        rule = rules.get(id(models[0].trainable_variables[index]))
        variable.assign(parts[0] if rule is None else join_slices(parts, rule))


def _copy_run_files(source, target, record):
    os.makedirs(target, exist_ok=True)
    write_json_atomically(os.path.join(target, CONFIG_FILE), record)
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if name == "data" and os.path.isdir(path):  # the input pipelines' positions
            shutil.copytree(path, os.path.join(target, name), dirs_exist_ok=True)
        elif name.startswith("tokenizer") or name == "vocab.txt":
            shutil.copyfile(path, os.path.join(target, name))


def _pipeline_stages(model, cut, sequence_length, train_config):
    """`[(stage, optimizer)]` of the pipeline `cut` of the whole `model`, each
    optimizer built on its stage's variables, as the run's ranks build theirs."""
    from tfgpt.distributed.pipeline_schedule import PipelineSchedule
    from tfgpt.distributed.pipeline_stage import PipelineStage
    from tfgpt.training.optimizers import make_optimizer

    stages, chunks = cut["pipeline_parallel"], cut["virtual_stages"]
    # A rank's blocks do not depend on the schedule or the micro-batches.
    schedule = PipelineSchedule("interleaved" if chunks > 1 else "1f1b", stages, stages, chunks)
    built = []
    for rank in range(stages):
        stage = PipelineStage(model, schedule, rank, partition=cut["pipeline_partition"],
                              sequence_length=sequence_length)
        optimizer = make_optimizer(train_config, 1)
        optimizer.build(stage.trainable_variables)
        built.append((stage, optimizer))
    return built


def _copy_optimizer_state(source, source_variables, target, target_variables):
    """Gives `target` the moments `source` holds of the variables both
    optimize, and `source`'s other variables (the step count)."""
    from tfgpt.training.sharded_checkpoint import replicated_optimizer_variables

    position = {id(v): index for index, v in enumerate(source_variables)}
    source_slots = slot_variables(source)
    for name, moments in slot_variables(target).items():
        for moment, variable in zip(moments, target_variables):
            if id(variable) in position:
                moment.assign(source_slots[name][position[id(variable)]])
    for mine, theirs in zip(replicated_optimizer_variables(target),
                            replicated_optimizer_variables(source)):
        mine.assign(theirs)


def merge(directory, out):
    """Writes `directory`'s latest tensor- or pipeline-parallel checkpoint as an
    ordinary one in `out`.

    Returns the written checkpoint's path.
    """
    from tfgpt.training.loop import seed_generator_states

    record, family, model_config, train_config = _run_configs(directory)
    path = tf.train.latest_checkpoint(directory)
    step = step_of(path)
    size, cut = slice_count(directory, step), _saved_cut(directory, step)
    if size is None and cut is None:
        raise ValueError(f"{path} is an ordinary checkpoint already: nothing to merge")
    if size is not None and record["train"].get("pipeline_parallel", 1) > 1:
        # Into a pipeline run's checkpoint of the same stages (its optimizer is per stage).
        from tfgpt.training import tensor_pipeline_checkpoint

        _copy_run_files(directory, out, dict(record, train=dict(record["train"], tensor_parallel=1)))
        return tensor_pipeline_checkpoint.merge(directory, out, record, family, model_config,
                                                train_config)
    model, optimizer = _build(family, model_config, train_config)
    if size is not None:
        # Slice 0's dropout states are the whole model's (the others' split
        # dropouts are offset from them).
        slices = _slices(directory, step, size, family, model_config, train_config)
        _join_into(_pairs(model, optimizer), [_pairs(m, o) for m, o in slices])
        record["train"]["tensor_parallel"] = 1
    else:
        # The chief's checkpoint has the whole model; each stage the moments of its part.
        tf.train.Checkpoint(model=model, rng=seed_generator_states(model)).read(
            path).assert_existing_objects_matched().expect_partial()  # (the step: below)
        stages = _pipeline_stages(model, cut, record["data"]["seq_len"], train_config)
        for rank, (stage, stage_optimizer) in enumerate(stages):
            read_optimizer_state(stage_directory(directory, rank), step, stage_optimizer,
                                 stage.trainable_variables, train_config)
            _copy_optimizer_state(stage_optimizer, stage.trainable_variables,
                                  optimizer, model.trainable_variables)
        record["train"].update(pipeline_parallel=1, microbatches=1, virtual_stages=1)
    _copy_run_files(directory, out, record)
    step_variable = tf.Variable(step, dtype=tf.int64)
    return Checkpointer(out, True, model=model, optimizer=optimizer, step=step_variable,
                        rng=seed_generator_states(model)).save(step)


def _write_stages(model, optimizer, cut, sequence_length, train_config, step, directory_of):
    """Writes the optimizer state of each stage of the pipeline `cut` of
    `model` (a whole model or a slice; `optimizer` holds its moments) in
    `directory_of(rank)`, as that stage's rank writes it."""
    for rank, (stage, stage_optimizer) in enumerate(
            _pipeline_stages(model, cut, sequence_length, train_config)):
        _copy_optimizer_state(optimizer, model.trainable_variables,
                              stage_optimizer, stage.trainable_variables)
        Checkpointer(directory_of(rank), True, optimizer=stage_optimizer).save(step)


def split(directory, out, size=1, pipeline=None):
    """Writes `directory`'s latest ordinary checkpoint in `out` as `size`
    slices, cut into the stages of `pipeline` (`HorovodOptions`: its
    `PIPELINE_CUT`, and the schedule and micro-batches written to the
    config), or both: each slice cut into the stages.

    Returns the written checkpoint's path.
    """
    if size == 1 and pipeline is None:
        raise ValueError("split needs --tensor-parallel T or --pipeline-parallel P "
                         "(above 1): the layout to cut the checkpoint into")
    record, family, model_config, train_config = _run_configs(directory)
    path = tf.train.latest_checkpoint(directory)
    step = step_of(path)
    check_whole(directory, path)
    from tfgpt.distributed.tensor_parallel import check_run
    from tfgpt.training.loop import seed_generator_states

    if pipeline is not None:
        from tfgpt.distributed.pipeline_partition import check_partition

        check_partition(model_config.num_layers,
                        pipeline.pipeline_parallel * pipeline.virtual_stages)
    if size > 1:
        check_run(size, family, model_config, train_config)
    model, optimizer = _build(family, model_config, train_config)
    step_variable = tf.Variable(0, dtype=tf.int64)
    tf.train.Checkpoint(model=model, optimizer=optimizer, step=step_variable,
                        rng=seed_generator_states(model)).read(path).assert_existing_objects_matched(
                        ).expect_partial()  # the manager's save counter
    sequence_length = record["data"]["seq_len"]
    if pipeline is not None:
        record["train"].update({name: getattr(pipeline, name) for name in (
            *PIPELINE_CUT, "pipeline_schedule", "microbatches")})
    if size == 1:
        _write_stages(model, optimizer, pipeline_cut(pipeline), sequence_length, train_config,
                      step, lambda rank: stage_directory(out, rank))
        _copy_run_files(directory, out, record)
        # The chief's checkpoint last: its index names the step once the stages are on disk.
        return Checkpointer(out, True, model=model, step=step_variable,
                            rng=seed_generator_states(model)).save(step)
    whole_pairs = _pairs(model, optimizer)
    for index in range(size):
        tensor_slice = TensorSlice(None, None, size, index)
        part, part_optimizer = _build(family, model_config, train_config, tensor_slice)
        for (variable, rule), (whole, _) in zip(_pairs(part, part_optimizer), whole_pairs):
            value = whole.numpy()
            variable.assign(value if rule is None else take_slice(value, rule, size, index))
        _offset_seeds(part, tensor_slice)
        if pipeline is None:
            tf.train.Checkpoint(**_trackables(part, part_optimizer)).write(
                slice_prefix(out, step, index, size))
            continue
        # The slice of every stage's blocks, and each stage's slice of the optimizer.
        from tfgpt.training.tensor_pipeline_checkpoint import optimizer_directory

        tf.train.Checkpoint(model=part, rng=seed_generator_states(part)).write(
            slice_prefix(out, step, index, size))
        _write_stages(part, part_optimizer, pipeline_cut(pipeline), sequence_length,
                      train_config, step,
                      lambda rank: optimizer_directory(out, rank, index, size))
    record["train"]["tensor_parallel"] = size
    _copy_run_files(directory, out, record)
    return Checkpointer(out, True, step=step_variable).save(step)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tfgpt.training.tensor_checkpoint", description=__doc__,
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser(
        "merge", help="tensor- or pipeline-parallel run (ZeRO-1 included) -> ordinary checkpoint")
    splitting = commands.add_parser(
        "split", help="ordinary run -> --tensor-parallel T slices, --pipeline-parallel P stages, "
                      "or both")
    for command in (merging, splitting):
        command.add_argument("run", help="the run directory (its latest checkpoint)")
        command.add_argument("out", help="the new run directory")
    defaults = HorovodOptions()
    splitting.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                           help="slices, as train_hvd.py --tensor-parallel (with "
                                "--pipeline-parallel: each slice cut into the stages)")
    splitting.add_argument("--pipeline-parallel", type=int, default=1, metavar="P",
                           help="stages, as train_hvd.py --pipeline-parallel; the next four "
                                "flags as the run that resumes will give them")
    splitting.add_argument("--microbatches", type=int, default=defaults.microbatches)
    splitting.add_argument("--pipeline-schedule", default=defaults.pipeline_schedule)
    splitting.add_argument("--virtual-stages", type=int, default=defaults.virtual_stages)
    splitting.add_argument("--pipeline-partition", default=defaults.pipeline_partition)
    args = parser.parse_args(argv)
    try:
        if args.command == "merge":
            path = merge(args.run, args.out)
        else:
            options = HorovodOptions(
                tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                microbatches=args.microbatches, pipeline_schedule=args.pipeline_schedule,
                virtual_stages=args.virtual_stages, pipeline_partition=args.pipeline_partition)
            path = split(args.run, args.out, options.tensor_parallel,
                         options if options.pipeline_parallel > 1 else None)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
