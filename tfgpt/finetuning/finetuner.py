"""Fine-tuning an encoder: sequence classification (GLUE SST-2 style) and SQuAD.

`finetune(config, model_overrides, distribution)` runs, in order: config,
data, model, optimizer, loop, save, evaluation. The front ends
(`finetune_hvd.py`, `finetune_mirrored.py`) only choose the distribution,
as the pretraining ones do, and the model and optimizer set-up, the
checkpoints and the loop are pretraining's (`tfgpt.training.loop`).

The pieces: `tfgpt.config.finetuning.FinetuneConfig` (the flags),
`tfgpt.finetuning.data` (the task files and the tokenizer),
`tfgpt.finetuning.task_models` (the encoder from `--init`, the head, the
loss) and `tfgpt.finetuning.evaluation` (predictions and scores). The
chief writes `predictions.json` and `eval_results.json` into `--out`.

Example:
>>> config = FinetuneConfig(task="classification", init="runs/bert",
...                         train_file="SST-2/train.tsv",
...                         validation_file="SST-2/dev.tsv")  # doctest: +SKIP
>>> model, metrics = finetune(config, {}, LocalDistribution())  # doctest: +SKIP
>>> metrics["val_accuracy"]  # doctest: +SKIP
"""

import dataclasses
import os

from tfgpt.checkpoint import read_config, write_json_atomically
from tfgpt.finetuning.data import (
    copy_tokenizer,
    encode_training_records,
    load_tokenizer,
    read_task_files,
    training_dataset,
)
from tfgpt.finetuning.evaluation import evaluate_classification, evaluate_squad
from tfgpt.finetuning.task_models import (
    apply_overrides,
    build_backbone,
    build_backbone_of,
    build_task_model,
    classification_loss,
    span_loss,
)
from tfgpt.observe.reporter import Reporter
from tfgpt.parallel import refusals
from tfgpt.parallel.local import LocalDistribution
from tfgpt.training import loop

PREDICTIONS_FILE = "predictions.json"
RESULTS_FILE = "eval_results.json"


def finetune(config, model_overrides=None, distribution=None, callbacks=()):
    """Fine-tunes and evaluates; returns `(model, metrics)`.

    Args:
        config: FinetuneConfig.
        model_overrides: dict of BertConfig/AlbertConfig fields set by
            flags (see `tfgpt.finetuning.flags.parse_flags`).
        distribution: a `tfgpt.parallel` object (local, Horovod, a
            tf.distribute strategy); None runs in this process alone.
        callbacks: `tfgpt.training.loop.Callback`s of the loop.

    Returns:
        The task model and a dict with the last logged training metrics
        (`loss`, `accuracy` of the training batches, ...) and the
        validation metrics with a `val_` prefix (`val_accuracy`, or
        `val_exact_match` and `val_f1`; also in `eval_results.json`,
        unprefixed).
    """
    if distribution is None:

        distribution = LocalDistribution()
    refusals.check(refusals.Run.of(
        distribution.state, elastic=getattr(distribution.options, "elastic", False),
        command="finetuning", config=config))
    model_overrides = dict(model_overrides or {})
    out = config.out

    # Config: resuming takes the architecture and labels from --out.
    saved = read_config(out) if loop.existing_checkpoints(config) else None
    if saved is not None and saved.get("task") != config.task:
        raise ValueError(
            f"--resume: --out {out} holds a {saved.get('task')!r} run, not --task {config.task}"
        )

    # Data: read and checked before any model is built.
    train, validation, labels, version = read_task_files(
        config, labels=saved["labels"] if saved else None
    )
    if saved and config.labels and config.declared_labels() != saved["labels"]:
        raise ValueError(
            f"--labels {config.labels} contradicts the run being resumed in --out {out} "
            f"(labels {','.join(saved['labels'])})"
        )
    tokenizer = load_tokenizer(config, out if saved else None)
    train_inputs, train_labels = encode_training_records(config, train, tokenizer)
    num_records = len(train_inputs["token_ids"])
    if num_records < distribution.num_workers:
        raise ValueError(
            f"{config.train_file}: {num_records} training record(s) cannot be split between "
            f"{distribution.num_workers} workers"
        )
    global_batch = config.batch_size * config.accumulation_steps * distribution.size
    steps = config.steps_for(num_records, global_batch)

    # Model: the encoder from --init (or --out when resuming), a new head.
    found = {}

    def build_model():
        if saved:
            family = saved["family"]
            model_config = apply_overrides(family, saved["model"], model_overrides, f"--out {out}")
            backbone = build_backbone_of(family, model_config)
        else:
            backbone, family, model_config = build_backbone(
                config, model_overrides, tokenizer.vocabulary_size
            )
        if tokenizer.vocabulary_size > model_config.vocabulary_size:
            raise ValueError(
                f"The tokenizer {tokenizer.path} has {tokenizer.vocabulary_size} ids, more than "
                f"the encoder's vocabulary_size={model_config.vocabulary_size}: they do not "
                "belong together"
            )
        if config.max_sequence_length > model_config.max_sequence_length:
            raise ValueError(
                "`max_sequence_length` exceeds the encoder's position table. Received: "
                f"max_sequence_length={config.max_sequence_length}, the encoder has "
                f"max_sequence_length={model_config.max_sequence_length}"
            )
        found.update(family=family, model_config=model_config)
        return build_task_model(config.task, backbone, len(labels), config.classifier_dropout)

    # Optimizer, with the model.
    part = loop.build_model_and_optimizer(config, distribution, build_model, steps)
    model, optimizer, step = part.model, part.optimizer, part.step
    family, model_config = found["family"], found["model_config"]
    report = Reporter(out, distribution.is_chief)
    towers = loop.towers_of(config, distribution)
    report.info(
        f"tfgpt finetune: {config.task} on a {family} encoder "
        f"({'resumed from ' + out if saved else config.init or 'random ' + config.preset}), "
        f"{distribution.num_workers} worker(s), {distribution.size} replica(s), "
        f"{num_records} training {'records' if config.task == 'classification' else 'windows'}, "
        f"global batch {global_batch}, {steps} steps, "
        f"{towers} tower(s) per replica"
        + (f", labels {labels}" if labels else "")
    )
    loop.start_up_warnings(report, config, steps, distribution)
    report.info(f"model: {model.count_params():,} parameters {model_config}")
    for line in part.describe():
        report.info(line)
    train_step = part.train_step(
        loss_fn=classification_loss if config.task == "classification" else span_loss,
        xla=config.xla,
        accumulation_steps=config.accumulation_steps,
        towers=towers,
        compute_delay=loop.compute_delay(callbacks),
    )

    # Checkpoints: the chief saves model, optimizer, step and dropout state.
    checkpointer = part.checkpointer(config)
    if saved:
        checkpointer.restore_latest()
        report.info(f"resumed from {checkpointer.latest} at step {int(step.numpy())}")
    checkpointer.write_run_files(
        {
            "family": family,
            "task": config.task,
            "model": dataclasses.asdict(model_config),
            "labels": labels,
            "finetune": loop.run_record(config, distribution),
            "steps": steps,
            "workers": distribution.num_workers,
            "replicas": distribution.size,
        }
    )
    if distribution.is_chief:
        copy_tokenizer(tokenizer, out)
    part.broadcast()

    # Data: each worker's part; a resumed run replays the seeded stream.
    replicas_per_worker = distribution.size // distribution.num_workers
    start = int(step.numpy())
    batches = iter(
        distribution.distribute_dataset(
            lambda context: training_dataset(
                train_inputs, train_labels, config, context, config.seed,
                skip=start * replicas_per_worker,
            )
        )
    )

    # Loop, and the last save.
    metrics = loop.run_loop(
        config,
        distribution,
        report,
        model=model,
        optimizer=optimizer,
        step=step,
        train_step=train_step,
        batches=batches,
        checkpointer=checkpointer,
        steps=steps,
        global_batch=global_batch,
        sequence_length=config.max_sequence_length,
        callbacks=callbacks,
    )
    # The training input is done with: its teardown must not hold up the end.
    loop.release_in_background(batches)
    del batches

    # Evaluation: every worker predicts its share; all of them see the result.
    part.sharding.materialize()  # ZeRO-3: the predictions run the whole model, not a loss
    if validation is not None:
        if config.task == "classification":
            predictions, results = evaluate_classification(
                model, config, tokenizer, validation, labels, distribution
            )
            line = (
                f"validation accuracy {results['accuracy']:.4f} "
                f"({results['correct']}/{results['total']})"
            )
        else:
            predictions, results = evaluate_squad(
                model, config, tokenizer, validation, version, distribution
            )
            line = (
                f"validation SQuAD v{version}: exact match {results['exact_match']:.2f}, "
                f"F1 {results['f1']:.2f} over {results['total']} questions"
            )
        if distribution.is_chief:
            write_json_atomically(os.path.join(out, PREDICTIONS_FILE), predictions)
            write_json_atomically(
                os.path.join(out, RESULTS_FILE), {"step": int(step.numpy()), **results}
            )
        report.scalars(
            int(step.numpy()),
            {name: results[name] for name in ("accuracy", "exact_match", "f1") if name in results},
            prefix="val",
        )
        report.info(line)
        metrics.update({f"val_{name}": value for name, value in results.items()})
    report.close()
    return model, metrics
