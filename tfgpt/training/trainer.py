"""Pretraining: one core for every front end, different distributions.

`train()` takes a TrainConfig, model overrides and a distribution object
(`tfgpt.parallel`) and runs, in order: config, data, model, optimizer,
loop, save, validation. The front ends (`train_hvd.py`, `train_mirrored.py`)
only choose the distribution. What fine-tuning shares with it (model and
optimizer, checkpoints, the loop) is `tfgpt.training.loop`.
"""

import dataclasses
import math
import os

import numpy as np
import tensorflow as tf

from pipelines import reader
from pipelines.files import file_sha256
from tfgpt import hf_files
from tfgpt.checkpoint import read_config
from tfgpt.config import FAMILIES, family_of_preset
from tfgpt.layers.transformer_block import set_recompute
from tfgpt.models.adapters import add_run_adapters
from tfgpt.observe.reporter import Reporter
from tfgpt.parallel import refusals, tensor_parallel
from tfgpt.resilience import elastic as elastic_training
from tfgpt.training import loop, objectives, pipeline_run
from tfgpt.training.loop import TrainingDiverged

__all__ = ["TrainingDiverged", "evaluate", "resolve_model_config", "train"]


def resolve_model_config(train_config, model_overrides, manifest, family, saved=None,
                         init=None):
    """Returns the model config for this run: preset, flags, the data, a checkpoint.

    The vocabulary size, and the pad id of a config that has one
    (RoBERTa's positions skip pads), come from the data's tokenizer unless a
    flag sets them. When resuming, the architecture comes from the checkpoint's
    config.json and a flag that contradicts it is an error; starting from
    `--init`, from its config.json (`init`), with the flags over it.
    """
    cls = FAMILIES[family].config_class
    data_vocabulary = manifest["tokenizer"]["vocabulary_size"]
    if saved is not None or init is not None:
        for name, value in model_overrides.items():
            # A model started from --init may change its dropout, not its shapes.
            if (saved or init).get(name) != value and (saved is not None or "dropout" not in name):
                where = (f"the checkpoint being resumed in --out {train_config.out}"
                         if saved is not None else f"the model of --init {train_config.init}")
                raise ValueError(f"--{name.replace('_', '-')} {value} contradicts {where} "
                                 f"({name}={(saved or init).get(name)!r})")
        config = cls(**{**(saved or init), **model_overrides})
    else:
        overrides = dict(model_overrides)
        overrides.setdefault("vocabulary_size", data_vocabulary)
        data_pad_id = manifest["tokenizer"].get("pad_id", -1)
        if "pad_id" in {field.name for field in dataclasses.fields(cls)} and data_pad_id >= 0:
            overrides.setdefault("pad_id", data_pad_id)
        config = cls.from_preset(train_config.preset, **overrides)
    if config.vocabulary_size < data_vocabulary:
        raise ValueError(
            "`vocabulary_size` is smaller than the data's tokenizer. Received: "
            f"vocabulary_size={config.vocabulary_size}, tokenizer has "
            f"{data_vocabulary} ids ({train_config.data})"
        )
    sequence_length = manifest["seq_len"]
    if sequence_length > config.max_sequence_length:
        raise ValueError(
            "The data's sequences are longer than the model's context. Received: "
            f"seq_len={sequence_length} in {train_config.data}, "
            f"max_sequence_length={config.max_sequence_length}"
        )
    return config


def read_init(train_config, family, manifest):
    """The model config (dict) of the run or the transformers decoder directory
    `--init` names, checked against this run's family and its data's tokenizer
    (the same file, by its SHA-256: `tfgpt.hf_files.tokenizer_file`)."""
    directory = train_config.init
    if hf_files.model_type_of(directory) is not None:  # a transformers decoder: its config.json
        from tfgpt.convert_decoders import hf_decoder_config

        config = {"family": "gpt", "model": dataclasses.asdict(hf_decoder_config(
            hf_files.read_hf_config(directory), source=os.path.join(directory, "config.json")))}
    else:
        config = read_config(directory)
    found = config.get("family", "gpt")  # (tfgpt.loading.save_model writes none: a GPT)
    if found != family or "model" not in config:
        raise ValueError(f"--init {directory} holds a {found} model; --preset "
                         f"{train_config.preset} trains a {family} model")
    tokenizer = hf_files.tokenizer_file(directory)
    if tokenizer is not None and (file_sha256(tokenizer)
                                  != manifest["tokenizer"].get("sha256")):
        raise ValueError(
            f"--data {train_config.data} was prepared with another tokenizer than the "
            f"model of --init {directory}: prepare it with --tokenizer {directory}")
    return config["model"]


def _with_adapters(model, train_config):
    """`model`, frozen with low-rank adapters when `--lora-rank` asks for them."""
    add_run_adapters(model, dataclasses.asdict(train_config))
    return model


def unigram_entropy(token_counts):
    """Entropy in nats of the empirical unigram distribution: the loss of the
    best predictor that ignores context."""
    probabilities = token_counts[token_counts > 0] / token_counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())


def batches_naming_bad_shards(dataset, data_dir, split):
    """Yields from `dataset`; a read error becomes one that names the bad shard.

    tf.data's DataLossError does not say which file it was reading: on that
    error the split's shards are checked against the manifest's sizes and
    checksums, which names the culprit.
    """
    iterator = iter(dataset)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except tf.errors.DataLossError as error:
            reader.verify_shards(data_dir, split)  # raises, naming the file
            raise ValueError(
                f"reading {split} shards of {data_dir} failed although every shard "
                f"matches its checksum: {error.message}"
            ) from error
        yield batch


def evaluate(task, eval_step, batches, distribution, max_batches, vocabulary_size):
    """Mean validation loss and metrics over all workers (and, for causal
    LM, the unigram baseline of the validation tokens).

    Each worker reads its own part of the split; sums and counts are
    averaged across workers so the result weights every batch equally, or,
    for a task whose loss is a weighted mean over tokens (`token_weights`),
    by its weight total: the mean over every learned token.
    """
    totals, count, batches_read = {}, 0, 0
    counts = np.zeros(vocabulary_size, np.float64)
    for batch in batches:
        loss, metrics = eval_step(batch)
        weight = (1.0 if task.token_weights is None
                  else float(tf.reduce_sum(task.token_weights(batch))))
        for name, value in {"loss": loss, **metrics}.items():
            totals[name] = totals.get(name, 0.0) + float(value) * weight
        summary = task.evaluation_summary(batch, vocabulary_size)
        if summary is not None:
            counts += summary
        count += weight
        batches_read += 1
        if max_batches and batches_read >= max_batches:
            break
    names = sorted(totals) if totals else ["loss"]
    sums = distribution.allreduce_mean(
        tf.constant([totals.get(name, 0.0) for name in names] + [float(count)], tf.float64)
    ).numpy()
    if sums[-1] == 0:
        raise ValueError("the validation split has no full batch for this batch size")
    results = {name: float(value / sums[-1]) for name, value in zip(names, sums[:-1])}
    if counts.any():
        summed_counts = distribution.allreduce_mean(tf.constant(counts, tf.float64))
        results["unigram_entropy"] = unigram_entropy(summed_counts.numpy())
    return results


def _check_batch_sizes(train_config, manifest, distribution):
    _, readers = distribution.data_shard()
    records = reader.records_per_worker(manifest, "train", readers)
    replicas_per_worker = distribution.size // readers
    needed = train_config.batch_size * train_config.accumulation_steps * replicas_per_worker
    if min(records) < needed:
        raise ValueError(
            f"--batch-size {train_config.batch_size} x --accumulation-steps "
            f"{train_config.accumulation_steps} needs {needed} training sequences per "
            f"worker, but {train_config.data} gives some of the {readers} "
            f"worker(s) only {min(records)}"
        )


def train(train_config, model_overrides, distribution, callbacks=()):
    """Trains the model `train_config` names; returns `(model, metrics)`.

    Args:
        train_config: TrainConfig.
        model_overrides: dict of model config fields set explicitly by flags.
        distribution: a `tfgpt.parallel` object (local, Horovod, ...).
        callbacks: `tfgpt.training.loop.Callback`s of the loop.
    """
    # Config: from the preset, the flags, the data and (resuming) the checkpoint.
    out = train_config.out
    manifest = reader.load_manifest(train_config.data)
    family = family_of_preset(train_config.preset).name
    task = objectives.make_task(FAMILIES[family].resolve_task(train_config.task), family)
    elastic = getattr(distribution.options, "elastic", False)
    if elastic:
        elastic_training.check_config(train_config, task.name)
    data_format = manifest.get("format", reader.PACKED_FORMAT)
    if data_format != task.data_format:
        hint = {"clm": "", "sft": " (prepare it with --format instructions)"}.get(
            task.name, " (prepare it with --format encoder)")
        raise ValueError(
            f"--task {task.name} reads {task.data_format!r} records, but --data "
            f"{train_config.data} holds {data_format!r} records{hint}"
        )
    tokenizer_file = manifest["tokenizer"].get("model_file")
    tokenizer_path = os.path.join(train_config.data, tokenizer_file) if tokenizer_file else None
    # An elastic job's worker started mid-run takes the job's own checkpoints
    # (and receives its state from rank 0).
    joining = elastic and elastic_training.joins_running_job(out)
    has_checkpoint = joining or loop.existing_checkpoints(train_config)
    saved = read_config(out)["model"] if has_checkpoint else None
    init = (read_init(train_config, family, manifest)
            if train_config.init and not has_checkpoint else None)
    model_config = resolve_model_config(
        train_config, model_overrides, manifest, family, saved=saved, init=init
    )
    refusals.check(refusals.Run.of(distribution.state, elastic=elastic, family=family,
                                   config=train_config))
    tensor_parallel.check_sizes(distribution.state.tensor, model_config)
    # The layout's part of the run: the whole model, or a pipeline's stage.
    layout = pipeline_run.PipelinePart if distribution.state.pipelined else loop.RunPart
    layout.check(train_config, distribution.options, model_config)
    if not elastic:  # the global order is endless: any batch size fits
        _check_batch_sizes(train_config, manifest, distribution)
    report = Reporter(out, distribution.is_chief)
    sequence_length = manifest["seq_len"]
    global_batch = train_config.batch_size * train_config.accumulation_steps * distribution.size
    towers = loop.towers_of(train_config, distribution)
    report.info(
        f"tfgpt: {family} {task.name}, {distribution.num_workers} worker(s), "
        f"{distribution.size} replica(s), "
        f"global batch {global_batch} x "
        f"{sequence_length} tokens ({train_config.batch_size} per replica x "
        f"{train_config.accumulation_steps} accumulated), {train_config.steps} steps, "
        f"precision {train_config.mixed_precision}, xla {train_config.xla}, "
        f"{towers} tower(s) per replica"
    )
    if distribution.state.split:
        report.info(distribution.state.describe())
    loop.start_up_warnings(report, train_config, train_config.steps, distribution)

    # Model and optimizer: identical initial weights everywhere (seeded, then broadcast).
    part = loop.build_model_and_optimizer(
        train_config, distribution, lambda: _with_adapters(
            objectives.build_model(family, model_config), train_config),
        train_config.steps, part=layout, sequence_length=sequence_length,
    )
    model, optimizer, step = part.model, part.optimizer, part.step
    parameters = f"{model.count_params():,} parameters"
    if distribution.state.tensor > 1:
        parameters = (f"{tensor_parallel.whole_parameters(model):,} parameters "
                      f"({model.count_params():,} per tensor slice)")
    report.info(f"model: {parameters} {model_config}")
    for line in part.describe():
        report.info(line)
    # Recomputation is a training-time choice, not architecture (not in config.json's model).
    if train_config.recompute and not set_recompute(model, True):
        raise ValueError(
            f"--recompute recomputes transformer blocks; --preset {train_config.preset} has none"
        )

    def build_train_step():
        return part.train_step(
            loss_fn=task.loss,
            xla=train_config.xla,
            accumulation_steps=train_config.accumulation_steps,
            towers=towers,
            compute_delay=loop.compute_delay(callbacks),
            token_weights=task.token_weights,
        )

    # Data: each worker reads its own part, in an order fixed by the seed
    # (elastic: its share of the global order from `cursor` on).
    def train_batches(seed, skip=0, cursor=None):
        def dataset_fn(input_context):
            dataset = task.dataset(
                train_config.data,
                "train",
                train_config.batch_size,
                shuffle=train_config.shuffle,
                seed=seed,
                input_context=input_context,
                deterministic=True,
                skip_corrupt=train_config.skip_corrupt,
                **({} if cursor is None else {"cursor": cursor}),
            )
            if train_config.accumulation_steps > 1:
                dataset = dataset.batch(train_config.accumulation_steps, drop_remainder=True)
            return dataset.skip(skip)

        return iter(distribution.distribute_dataset(dataset_fn))

    run_files = {
        "family": family,
        "task": task.name,
        "model": dataclasses.asdict(model_config),
        "train": loop.run_record(train_config, distribution),
        "data": {"seq_len": sequence_length, "directory": os.path.abspath(train_config.data)},
        "workers": distribution.num_workers,
        "replicas": distribution.size,
        # Instruction data's chat template: what `tfgpt.generate --chat` renders with.
        **{key: manifest[key] for key in ("chat_template",) if key in manifest},
        # A transformers directory's tokenizer.json: the end-of-text id that `tfgpt.loading`
        # reads beside it (`tfgpt.tokenizers.tokenizer_json.configured_eos`).
        **({"eos_token_id": manifest["tokenizer"]["eos_id"]}
           if tokenizer_file == hf_files.TOKENIZER_JSON_FILE else {}),
        # Where an --init from a transformers directory started: its files' identity.
        **({"init": hf_files.identity(train_config.init)}
           if train_config.init and hf_files.model_type_of(train_config.init) else {}),
    }
    if elastic:
        metrics = _train_elastic(
            train_config, distribution, report, part=part, init=init, joining=joining,
            build_train_step=build_train_step, train_batches=train_batches, run_files=run_files,
            tokenizer_path=tokenizer_path, sequence_length=sequence_length, callbacks=callbacks,
        )
        return _validate(task, train_config, distribution, report, part, model_config,
                         metrics, int(step.numpy()))

    train_step = build_train_step()
    # --global-order: the position is one number, the records of the global
    # order consumed, whatever the layout.
    global_order = train_config.global_order
    data_cursor = (tf.Variable(0, dtype=tf.int64, trainable=False, name="data_cursor")
                   if global_order else None)
    iterator = train_batches(train_config.seed, cursor=0 if global_order else None)
    # A plain tf.data iterator checkpoints its position (O(1) to restore);
    # tf.distribute's distributed iterators cannot, so those runs replay the
    # seeded, deterministic stream and skip what was consumed.
    iterator_checkpointable = not global_order and isinstance(
        iterator, tf.__internal__.tracking.Trackable)

    # Checkpoints: every rank saves its part of the state, and the first
    # rank of each input pipeline its position (the ranks of a tensor group
    # and the stages of a pipeline share one).
    checkpointer = part.checkpointer(train_config, data_cursor=data_cursor)
    data_index, readers = distribution.data_shard()
    if train_config.resume and checkpointer.latest:
        if global_order:
            elastic_training.check_resumable(checkpointer.latest, "--global-order")
        path = checkpointer.restore_latest()
        replicas_per_worker = distribution.size // readers
        if global_order:
            cursor = int(data_cursor.numpy())
            iterator = train_batches(train_config.seed, cursor=cursor)
            position = f"data position {cursor} of the global order"
        elif not iterator_checkpointable:
            iterator = train_batches(train_config.seed, skip=int(step.numpy()) * replicas_per_worker)
            position = "the next unseen batch (replayed)"
        elif checkpointer.restore_input(path, iterator, data_index, readers):
            position = "the next unseen batch"
        else:
            # Another worker count than the saved run: no position to take over.
            iterator = train_batches(train_config.seed + int(step.numpy()))
            position = (
                f"data reshuffled (no position saved for {readers} worker(s))"
            )
        report.info(f"resumed from {path} at step {int(step.numpy())}, {position}")
    if init is not None:
        report.info(f"initialized from {part.initialize_from(train_config.init)} (--init): "
                    "the model's weights; the optimizer and the step start afresh")
    if iterator_checkpointable:
        checkpointer.track_input(iterator, data_index, readers)
    checkpointer.write_run_files(run_files, tokenizer_path=tokenizer_path)
    # Keras 3 creates the optimizer's slots in build(), so rank 0's full
    # state can be broadcast before the first step (Horovod's TF1-era
    # examples had to wait until after it for the slots to exist).
    part.broadcast()

    # Loop, and the last save.
    metrics = loop.run_loop(
        train_config,
        distribution,
        report,
        model=model,
        optimizer=optimizer,
        step=step,
        train_step=train_step,
        batches=distribution.one_batch_per_group(
            batches_naming_bad_shards(iterator, train_config.data, "train"),
            every_step=getattr(distribution.options, "check_batches", False)),
        checkpointer=checkpointer,
        steps=train_config.steps,
        global_batch=global_batch,
        sequence_length=sequence_length,
        perplexity=True,
        callbacks=[*callbacks, *([loop.EachStep(lambda done: data_cursor.assign_add(global_batch))]
                                 if global_order else [])],
    )
    # The training input is done with: its teardown must not hold up the end.
    checkpointer.track_input(None)
    loop.release_in_background(iterator)
    del iterator
    return _validate(task, train_config, distribution, report, part, model_config,
                     metrics, int(step.numpy()))


def _validate(task, train_config, distribution, report, part, model_config, metrics, at_step):
    """Validation after training: logs it and returns `(model, metrics)` with its results.

    `part`: the run's `tfgpt.training.loop.RunPart` (a pipeline validates
    through its stages, each rank holding its own).
    """
    # A tensor group and a pipeline read one part, in one order (checked at the first batch).
    data_index, readers = distribution.data_shard()
    validation = task.dataset(
        train_config.data,
        "val",
        train_config.batch_size,
        shuffle=False,
        repeat=False,
        seed=train_config.seed,
        num_shards=readers,
        shard_index=data_index,
        deterministic=True,
    )
    results = evaluate(
        task,
        part.eval_step(task.loss, xla=train_config.xla),
        distribution.one_batch_per_group(
            batches_naming_bad_shards(validation, train_config.data, "val")),
        distribution,
        train_config.eval_batches,
        model_config.vocabulary_size,
    )
    metrics.update({f"val_{name}" if name != "unigram_entropy" else name: value
                    for name, value in results.items()})
    report.scalars(at_step, results, prefix="val")
    line = (f"validation loss {results['loss']:.4f} nats/token "
            f"(perplexity {math.exp(min(results['loss'], 50.0)):.1f})")
    if "unigram_entropy" in results:
        line += f"; unigram baseline {results['unigram_entropy']:.4f}"
    for name in sorted(results):
        if name.endswith("accuracy"):
            line += f"; {name.replace('_', ' ')} {results[name]:.3f}"
    report.info(line)
    report.close()
    return part.model, metrics


def _train_elastic(train_config, distribution, report, *, part, init, joining, build_train_step,
                   train_batches, run_files, tokenizer_path, sequence_length, callbacks):
    """Checkpoints and loop of an elastic run (`tfgpt.resilience.elastic`); returns the
    last metrics.

    The chief resumes from disk (`--resume`) and writes the run files
    naming the job; the first formation's sync gives every worker its
    state, and a worker that joins later gets it the same way.
    """
    if elastic_training.job() is None:
        report.info("warning: --elastic outside an elastic horovodrun (--host-discovery-script): "
                    "a lost worker ends the run and none can join")
    data_cursor = tf.Variable(0, dtype=tf.int64, trainable=False, name="data_cursor")

    # One checkpointer for every formation: it asks who the chief is at each save.
    checkpointer = part.checkpointer(train_config, data_cursor=data_cursor)
    step = part.step
    if train_config.resume and checkpointer.latest and not joining:
        elastic_training.check_resumable(checkpointer.latest, "--elastic")
        checkpointer.restore_latest()
        report.info(f"resumed from {checkpointer.latest} at step {int(step.numpy())}, data "
                    f"position {int(data_cursor.numpy())} of the global order")
    elif init is not None and not joining:  # (the formations' sync gives it to the others)
        report.info(f"initialized from {part.initialize_from(train_config.init)} (--init)")
    if not joining:
        run_files = dict(run_files, **{elastic_training.JOB_KEY: elastic_training.job()})
        checkpointer.write_run_files(run_files, tokenizer_path=tokenizer_path)
    return elastic_training.run_formations(
        train_config, distribution.options, distribution, report, model=part.model,
        optimizer=part.optimizer, step=step, data_cursor=data_cursor,
        build_train_step=build_train_step,
        build_batches=lambda cursor: batches_naming_bad_shards(
            train_batches(train_config.seed, cursor=cursor), train_config.data, "train"),
        checkpointer=checkpointer, sequence_length=sequence_length, callbacks=callbacks,
    )
