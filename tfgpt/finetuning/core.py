"""Fine-tuning an encoder: sequence classification (GLUE SST-2 style) and SQuAD.

`finetune(config, distribution)` runs, in order: config, data, model,
optimizer, loop, save, evaluation. The front ends (`finetune_hvd.py`,
`finetune_mirrored.py`) only choose the distribution, as the pretraining
ones do, and the step, checkpoints and logging are the trainer core's
(`TrainStep`, `Checkpointer`, `Reporter`, `make_optimizer`).

Where the encoder comes from (`--init`):

- a tfgpt encoder run directory (`train_hvd.py --preset bert-*|albert-*`,
  or a fine-tuning run): the backbone is built from its `config.json`
  (`family`, `model`) and restored from its latest checkpoint; the
  pretraining heads are not needed and are not restored;
- a Hugging Face BERT/ALBERT directory (`config.json` with `model_type`,
  `model.safetensors`): read by `tfgpt.convert_encoders`;
- nothing (`--init ""`): a randomly initialised `--preset`, with model
  flags overriding it and `--tokenizer` naming the tokenizer (tests).

The tokenizer is the init directory's (`tokenizer.model`, `spiece.model`
or `vocab.txt`) unless `--tokenizer` names one; see
`tfgpt.finetuning.offset_tokenizer`.

Evaluation at the end reads the whole validation file. Each worker
predicts its share of it (record or question i goes to worker
i mod workers); the predictions are gathered on every worker through the
distribution's `allreduce_mean` (see `gather_objects`), and accuracy, or
exact match and F1 to the official SQuAD definitions
(`tfgpt.finetuning.squad_metrics`), are computed over all of them. The chief
writes `predictions.json` and `eval_results.json` into `--out`.

Example:
>>> config = FinetuneConfig(task="classification", init="runs/bert",
...                         train_file="SST-2/train.tsv",
...                         validation_file="SST-2/dev.tsv")  # doctest: +SKIP
>>> model, metrics = finetune(config, LocalDistribution())  # doctest: +SKIP
>>> metrics["val_accuracy"]  # doctest: +SKIP
"""

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import time

import numpy as np

from tfgpt.config import (
    ALLREDUCE_BUCKET_MB,
    ALBERT_PRESETS,
    BERT_PRESETS,
    MIXED_PRECISION,
    OPTIMIZERS,
    SCHEDULES,
    AlbertConfig,
    BertConfig,
    TrainConfig,
    require_towers_divide_batch,
)

TASKS = ("classification", "squad")
# Input length when --max-sequence-length is 0: BERT's GLUE and SQuAD settings.
DEFAULT_SEQUENCE_LENGTH = {"classification": 128, "squad": 384}
PREDICTIONS_FILE = "predictions.json"
RESULTS_FILE = "eval_results.json"
ENCODER_CONFIGS = {"bert": BertConfig, "albert": AlbertConfig}
_POLICIES = {"off": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


@dataclasses.dataclass
class FinetuneConfig:
    """What to fine-tune on which data, and how.

    Every field is a flag of `finetune_hvd.py` and `finetune_mirrored.py`
    (`train_file` is `--train-file`).

    Args:
        task: str. `classification` (text -> label, accuracy) or `squad`
            (extractive question answering, exact match and F1).
        init: str. The encoder to start from: a tfgpt BERT/ALBERT run
            directory, a Hugging Face BERT/ALBERT directory, or "" for a
            random `preset` (with model flags; for tests).
        preset: str. `bert-*` or `albert-*` preset; used only when `init`
            is "".
        tokenizer: str. Tokenizer file or directory; "" takes the one in
            `init` (required when `init` is "").
        train_file: str. Classification: a GLUE-style `.tsv` (header
            `sentence<TAB>label`) or `.jsonl` (`{"text", "label"}`).
            SQuAD: a v1.1 or v2.0 JSON file.
        validation_file: str. The same layout; evaluated at the end ("" to
            skip evaluation).
        labels: str. Classification: the declared label set, comma
            separated (`negative,positive`); label i of the list is class
            i. "" infers it from the training file: its distinct labels,
            sorted numerically if all are integers (GLUE's `0,1`) and as
            strings otherwise. The validation file's labels must be in
            the set either way.
        max_sequence_length: int. Tokens per input, special tokens
            included; 0 means 128 for classification and 384 for SQuAD.
        doc_stride: int. SQuAD: tokens between the starts of successive
            windows of a long context; at most
            max_sequence_length - max_query_length - 3.
        max_query_length: int. SQuAD: questions are cut to this many tokens.
        max_answer_length: int. SQuAD: longest predicted answer, in tokens.
        n_best: int. SQuAD: candidate starts and ends per window.
        no_answer_threshold: float. SQuAD v2.0: how much the no-answer
            score must beat the best span to predict "".
        classifier_dropout: float. Dropout on the pooled output before the
            classification head.
        batch_size: int. Sequences (SQuAD: windows) per replica per step.
        steps: int. Optimizer steps; 0 derives them from `epochs`.
        epochs: float. Passes over the training file when `steps` is 0:
            steps = round(epochs x records / global batch), at least 1.
        learning_rate: float. Peak learning rate (BERT fine-tunes with
            2e-5 to 5e-5).
        scale_learning_rate: bool. Multiply the learning rate by the number
            of replicas (off: fine-tuning rates are tuned per global batch).
        warmup_fraction: float. Fraction of the steps with linear warmup
            (BERT: 0.1).
        schedule: str. Decay after warmup: linear (BERT), cosine or constant.
        final_learning_rate_ratio: float. Learning rate at the last step as
            a fraction of the peak.
        optimizer: str. `adamw` or `lamb`.
        weight_decay: float. Decoupled weight decay (not on biases, norms,
            embeddings).
        gradient_clip_norm: float. Global-norm clipping; 0 disables it.
        accumulation_steps: int. Micro-batches averaged per update.
        xla: bool. JIT-compile the step and the predictions with XLA.
        mixed_precision: str. off, float16 or bfloat16.
        seed: int. Seed for the heads' initial weights, dropout and order.
        shuffle: bool. Shuffle the training records (seeded).
        out: str. Output directory: checkpoints, config.json, tokenizer,
            metrics.jsonl, predictions.json, eval_results.json.
        log_every: int. Steps between log lines.
        save_every: int. Steps between checkpoints; 0 saves at the end only.
        keep_checkpoints: int. Checkpoints kept.
        resume: bool. Continue from the latest checkpoint in `out`; the
            architecture and labels come from `out`, not from `init`.
        intra_op_threads: int. Threads per worker for one op; 0 divides the
            machine's cores among the workers on it.
        towers: int. Slices of each batch run side by side (TrainConfig's
            `towers`); 0 chooses. Must divide `batch_size`.
        fp16_allreduce: bool. Horovod only: send gradients as float16.
        allreduce_bucket_mb: float. Horovod only: megabytes of gradients
            per grouped allreduce; 0 sends each gradient on its own.
    """

    task: str = "classification"
    init: str = ""
    preset: str = "bert-demo"
    tokenizer: str = ""
    train_file: str = ""
    validation_file: str = ""
    labels: str = ""
    max_sequence_length: int = 0
    doc_stride: int = 128
    max_query_length: int = 64
    max_answer_length: int = 30
    n_best: int = 20
    no_answer_threshold: float = 0.0
    classifier_dropout: float = 0.1
    batch_size: int = 32
    steps: int = 0
    epochs: float = 3.0
    learning_rate: float = 5e-5
    scale_learning_rate: bool = False
    warmup_fraction: float = 0.1
    schedule: str = "linear"
    final_learning_rate_ratio: float = 0.0
    optimizer: str = "adamw"
    weight_decay: float = 0.01
    gradient_clip_norm: float = 1.0
    accumulation_steps: int = 1
    xla: bool = False
    mixed_precision: str = "off"
    seed: int = 0
    shuffle: bool = True
    out: str = "runs/finetune"
    log_every: int = 10
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    intra_op_threads: int = 0
    towers: int = 0
    fp16_allreduce: bool = False
    allreduce_bucket_mb: float = ALLREDUCE_BUCKET_MB

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"`task` must be one of {TASKS}. Received: task={self.task!r}")
        if not self.train_file:
            raise ValueError("`train_file` is required.")
        if not self.init and not self.tokenizer:
            raise ValueError(
                "`tokenizer` is required when `init` is empty (a random model has none)."
            )
        presets = {**BERT_PRESETS, **ALBERT_PRESETS}
        if self.preset not in presets:
            raise ValueError(
                f"`preset` must be a BERT or ALBERT preset. Received: preset={self.preset!r}. "
                f"Expected one of: {', '.join(sorted(presets))}"
            )
        for name in ("batch_size", "log_every", "keep_checkpoints", "accumulation_steps",
                     "doc_stride", "max_query_length", "max_answer_length", "n_best"):
            _require(name, getattr(self, name), minimum=1)
        for name in ("steps", "save_every", "intra_op_threads", "max_sequence_length", "towers"):
            _require(name, getattr(self, name), minimum=0)
        require_towers_divide_batch(self.batch_size, self.towers)
        for name, allowed in (
            ("mixed_precision", MIXED_PRECISION),
            ("schedule", SCHEDULES),
            ("optimizer", OPTIMIZERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"`{name}` must be one of {allowed}. Received: {name}={getattr(self, name)!r}"
                )
        if not self.allreduce_bucket_mb >= 0:
            raise ValueError(
                "`allreduce_bucket_mb` must be non-negative. "
                f"Received: allreduce_bucket_mb={self.allreduce_bucket_mb!r}"
            )
        if not self.learning_rate > 0:
            raise ValueError(
                f"`learning_rate` must be positive. Received: learning_rate={self.learning_rate!r}"
            )
        if self.steps == 0 and not self.epochs > 0:
            raise ValueError(
                f"`epochs` must be positive when `steps` is 0. Received: epochs={self.epochs!r}"
            )
        for name in ("warmup_fraction", "final_learning_rate_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"`{name}` must be in [0, 1]. Received: {name}={getattr(self, name)!r}"
                )
        if not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(
                "`classifier_dropout` must be in [0, 1). "
                f"Received: classifier_dropout={self.classifier_dropout!r}"
            )
        for name in ("weight_decay", "gradient_clip_norm"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"`{name}` must be non-negative. Received: {name}={getattr(self, name)!r}"
                )
        if self.labels:
            self.declared_labels()  # validates
        if self.max_sequence_length == 0:
            # Resolved here so that config.json records the length used.
            self.max_sequence_length = DEFAULT_SEQUENCE_LENGTH[self.task]
        if self.task == "squad":
            window = self.max_sequence_length - self.max_query_length - 3
            if window < 1:
                raise ValueError(
                    "`max_sequence_length` leaves no room for the context after "
                    "`max_query_length` question tokens and 3 special tokens. Received: "
                    f"max_sequence_length={self.max_sequence_length}, "
                    f"max_query_length={self.max_query_length}"
                )
            if self.doc_stride > window:
                raise ValueError(
                    "`doc_stride` must be at most max_sequence_length - max_query_length - 3 "
                    f"= {window}, or context tokens between windows are never seen. Received: "
                    f"doc_stride={self.doc_stride}"
                )
        elif self.max_sequence_length < 3:
            raise ValueError(
                "`max_sequence_length` must be at least 3 ([CLS] text [SEP]). "
                f"Received: max_sequence_length={self.max_sequence_length}"
            )

    def declared_labels(self):
        """The `labels` field as a list, or None when it is to be inferred."""
        if not self.labels:
            return None
        names = [name.strip() for name in self.labels.split(",")]
        if len(names) < 2 or "" in names or len(set(names)) != len(names):
            raise ValueError(
                "`labels` must list at least two distinct, non-empty labels, comma "
                f"separated. Received: labels={self.labels!r}"
            )
        return names

    def train_config(self, steps):
        """The TrainConfig that `make_optimizer` reads, for `steps` steps."""
        return TrainConfig(
            data=self.train_file,
            steps=steps,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            scale_learning_rate=self.scale_learning_rate,
            warmup_steps=int(round(self.warmup_fraction * steps)),
            schedule=self.schedule,
            final_learning_rate_ratio=self.final_learning_rate_ratio,
            optimizer=self.optimizer,
            weight_decay=self.weight_decay,
            gradient_clip_norm=self.gradient_clip_norm,
            accumulation_steps=self.accumulation_steps,
            xla=self.xla,
            mixed_precision=self.mixed_precision,
            seed=self.seed,
            out=self.out,
        )


def _require(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"`{name}` must be {kind} integer. Received: {name}={value!r}")


# ---- Flags ------------------------------------------------------------------


def parse_flags(argv=None, description="Fine-tune an encoder.", add_arguments=None):
    """Parses `argv` into `(FinetuneConfig, model_overrides)`.

    Every FinetuneConfig field is a flag; so is every BertConfig and
    AlbertConfig field except `max_sequence_length` (the input length
    here; a random model keeps its preset's position table). Model flags
    shape a random model (`--init ""`); with `--init` only `--dropout`
    may differ from the checkpoint's architecture. Invalid values exit
    with status 2 and one `error:` line.

    `add_arguments(parser)` may add a front end's own flags and return
    their names; their values are returned as a third element, a dict.
    """
    from tfgpt.training.flags import _add_fields

    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    defaults = {field.name: field.default for field in dataclasses.fields(FinetuneConfig)}
    _add_fields(parser.add_argument_group("fine-tuning"), FinetuneConfig, defaults)
    # Model flags default to None: "take the preset's (or checkpoint's) value".
    model = parser.add_argument_group("model (a random --preset; only --dropout with --init)")
    seen = set(defaults)
    for cls in ENCODER_CONFIGS.values():
        _add_fields(model, cls, {}, seen)
    extra_names = add_arguments(parser) if add_arguments else ()
    args = vars(parser.parse_args(argv))
    extras = {name: args.pop(name) for name in extra_names}
    config_args = {name: args.pop(name) for name in defaults}
    model_overrides = {name: value for name, value in args.items() if value is not None}
    try:
        config = FinetuneConfig(**config_args)
        if not config.init:
            family = "bert" if config.preset in BERT_PRESETS else "albert"
            cls = ENCODER_CONFIGS[family]
            fields = {field.name for field in dataclasses.fields(cls)}
            for name in model_overrides:
                if name not in fields:
                    raise ValueError(
                        f"--{name.replace('_', '-')} is not a {cls.__name__} field "
                        f"(--preset {config.preset} is a {family} model)"
                    )
            cls.from_preset(config.preset, **model_overrides)
    except ValueError as error:
        parser.error(str(error))
    if add_arguments:
        return config, model_overrides, extras
    return config, model_overrides


# ---- Data -------------------------------------------------------------------


def infer_labels(path):
    """The distinct labels of a classification file, sorted (see `FinetuneConfig.labels`)."""
    from tfgpt.finetuning import classification

    extension = os.path.splitext(path)[1].lower()
    if extension == ".tsv":
        records = classification._read_tsv(path)
    elif extension in (".jsonl", ".json"):
        records = classification._read_jsonl(path)
    else:
        raise ValueError(
            f"Unknown classification file type (expected .tsv, .jsonl or .json). Received: {path}"
        )
    labels = sorted({label for _, _, label in records})
    if all(_is_integer(label) for label in labels):
        labels.sort(key=int)
    if len(labels) < 2:
        raise ValueError(
            f"{path}: found {len(labels)} distinct label(s) {labels}; a classifier needs "
            "at least two (declare them with --labels)"
        )
    return labels


def _is_integer(text):
    try:
        int(text)
    except ValueError:
        return False
    return True


def read_task_files(config, labels=None):
    """Reads and checks the training and validation files (before any model is built).

    Returns `(train, validation, labels, version)`: raw records, not yet
    tokenized. Errors name the file and line (classification) or the
    question id (SQuAD).
    """
    from tfgpt.finetuning.classification import read_classification_file
    from tfgpt.finetuning.squad import read_squad

    if config.task == "classification":
        labels = labels or config.declared_labels() or infer_labels(config.train_file)
        train = read_classification_file(config.train_file, labels)
        validation = (
            read_classification_file(config.validation_file, labels)
            if config.validation_file
            else None
        )
        return train, validation, labels, ""
    _, train = read_squad(config.train_file)
    version, validation = "", None
    if config.validation_file:
        version, validation = read_squad(config.validation_file)
    return train, validation, [], version


def encode_training_records(config, train, tokenizer):
    """Token ids and labels of the training set: (inputs dict, labels)."""
    from tfgpt.finetuning.classification import encode_classification
    from tfgpt.finetuning.squad import squad_features

    if config.task == "classification":
        texts, label_ids = train
        return encode_classification(texts, tokenizer, config.max_sequence_length), label_ids
    features = squad_features(
        train,
        tokenizer,
        max_sequence_length=config.max_sequence_length,
        stride=config.doc_stride,
        max_question_length=config.max_query_length,
    )
    labels = {"start_positions": features.start_positions, "end_positions": features.end_positions}
    return features.inputs(), labels


def training_dataset(inputs, labels, config, input_context, seed, skip=0):
    """This worker's endless stream of training batches.

    The records are split between workers by index (record i goes to
    input pipeline i mod pipelines) before any shuffle, so together the
    workers read every record once per epoch. With `shuffle` off and an
    even split, step k of N workers sees the same records as step k of one
    worker with an N times larger batch, which the tests rely on.
    """
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((inputs, labels))
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    if config.shuffle:
        records = -(-len(inputs["token_ids"]) // input_context.num_input_pipelines)
        dataset = dataset.shuffle(records, seed=seed, reshuffle_each_iteration=True)
    # Repeat before batching: batches run across epoch ends, never short.
    dataset = dataset.repeat().batch(config.batch_size, drop_remainder=True)
    if config.accumulation_steps > 1:
        dataset = dataset.batch(config.accumulation_steps, drop_remainder=True)
    return dataset.skip(skip).prefetch(2)


# ---- Model ------------------------------------------------------------------


def _backbone_class(family):
    from tfgpt.models.albert import AlbertBackbone
    from tfgpt.models.bert import BertBackbone

    return {"bert": BertBackbone, "albert": AlbertBackbone}[family]


def _apply_overrides(family, fields, model_overrides, source):
    """Architecture fields from `source`; only `dropout` may be overridden."""
    cls = ENCODER_CONFIGS[family]
    known = {field.name for field in dataclasses.fields(cls)}
    fields = dict(fields)
    for name, value in model_overrides.items():
        flag = f"--{name.replace('_', '-')}"
        if name not in known:
            raise ValueError(f"{flag} is not a {cls.__name__} field ({source} is a {family} model)")
        if name == "dropout":
            fields[name] = value
        elif fields.get(name) != value:
            raise ValueError(
                f"{flag} {value} contradicts {source}, which has {name}={fields.get(name)!r}: "
                "the architecture comes from the checkpoint (only --dropout may differ)"
            )
    try:
        return cls(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: not a valid {cls.__name__} ({error})") from None


def describe_init(init):
    """`("tfgpt" | "huggingface", family, saved config dict)` of an init directory."""
    config_path = os.path.join(init, "config.json")
    if not os.path.isdir(init):
        raise ValueError(f"--init {init}: not a directory")
    try:
        with open(config_path, encoding="utf-8") as file:
            saved = json.load(file)
    except OSError:
        raise ValueError(
            f"--init {init}: no config.json, so neither a tfgpt run directory nor a "
            "Hugging Face checkpoint directory"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: malformed JSON ({error})") from None
    if "model_type" in saved:
        family = saved["model_type"]
        kind = "huggingface"
    elif "family" in saved and "model" in saved:
        family = saved["family"]
        kind = "tfgpt"
    else:
        raise ValueError(
            f"{config_path}: neither a tfgpt run's config (\"family\", \"model\") nor a "
            "Hugging Face config (\"model_type\")"
        )
    if family not in ENCODER_CONFIGS:
        raise ValueError(
            f"--init {init} holds a {family!r} model; fine-tuning needs a BERT or ALBERT "
            "encoder (family 'bert' or 'albert')"
        )
    return kind, family, saved


def restore_backbone(backbone, directory, checkpoint_path=None):
    """Restores `backbone` from a tfgpt run's checkpoint (pretraining or fine-tuning).

    Only the backbone is matched: the checkpoint's heads, optimizer and
    step are left out. Raises ValueError naming the directory, and the
    variable and shapes, when the checkpoint holds another architecture
    than `backbone`.
    """
    import tensorflow as tf

    path = checkpoint_path or tf.train.latest_checkpoint(directory)
    if path is None:
        raise ValueError(f"--init {directory}: config.json but no checkpoint (ckpt-N)")
    # Pretraining (Bert/Albert) and fine-tuning models all keep the encoder
    # under `model.backbone`; restore through a stand-in for `model`.
    checkpoint = tf.train.Checkpoint(model=tf.train.Checkpoint(backbone=backbone))
    try:
        status = checkpoint.restore(path)
        status.expect_partial()
        status.assert_existing_objects_matched()
    except (ValueError, AssertionError, tf.errors.InvalidArgumentError) as error:
        message = str(error).splitlines()[0].strip()
        if isinstance(error, AssertionError):
            # TensorFlow lists the unmatched variables with their values.
            unmatched = re.findall(r"path=([^,]+), shape=(\([^)]*\))", str(error))
            message = (
                f"{len(unmatched)} variable(s) of the model have no value in the checkpoint, "
                f"e.g. {', '.join(f'{path} {shape}' for path, shape in unmatched[:3])}"
                if unmatched
                else message[:300]
            )
        raise ValueError(
            f"--init {directory}: {os.path.basename(path)} does not hold the "
            f"{type(backbone).__name__} that its config.json describes (a checkpoint of "
            f"another architecture): {message}"
        ) from None
    return path


def build_backbone(config, model_overrides, tokenizer_vocabulary):
    """`(backbone, family, model config)` from `config.init` (see the module docstring)."""
    from tfgpt.convert_encoders import hf_encoder_config, load_hf_weights

    if not config.init:
        family = "bert" if config.preset in BERT_PRESETS else "albert"
        overrides = dict(model_overrides)
        overrides.setdefault("vocabulary_size", tokenizer_vocabulary)
        model_config = ENCODER_CONFIGS[family].from_preset(config.preset, **overrides)
        return _backbone_class(family)(**dataclasses.asdict(model_config)), family, model_config
    kind, family, saved = describe_init(config.init)
    if kind == "tfgpt":
        model_config = _apply_overrides(
            family, saved["model"], model_overrides, f"--init {config.init}"
        )
        backbone = _backbone_class(family)(**dataclasses.asdict(model_config))
        restore_backbone(backbone, config.init)
        return backbone, family, model_config
    source = f"--init {config.init}"
    hf_config = hf_encoder_config(saved, os.path.join(config.init, "config.json"))
    model_config = _apply_overrides(family, dataclasses.asdict(hf_config), model_overrides, source)
    backbone = _backbone_class(family)(**dataclasses.asdict(model_config))
    load_hf_weights(backbone, config.init)
    return backbone, family, model_config


def build_task_model(task, backbone, num_classes, classifier_dropout):
    from tfgpt.models.sequence_classifier import SequenceClassifier
    from tfgpt.models.span_question_answerer import SpanQuestionAnswerer

    if task == "classification":
        return SequenceClassifier(backbone, num_classes=num_classes, dropout=classifier_dropout)
    return SpanQuestionAnswerer(backbone)


def classification_loss(model, batch, training):
    """Cross-entropy of the class logits, and the batch's accuracy."""
    import tensorflow as tf

    from tfgpt.training.train_step import cross_entropy

    inputs, labels = batch
    logits = model(inputs, training=training)  # (B, classes) float32
    predicted = tf.cast(tf.argmax(logits, -1), "int32")
    accuracy = tf.reduce_mean(tf.cast(tf.equal(predicted, tf.cast(labels, "int32")), "float32"))
    return cross_entropy(labels, logits), {"accuracy": accuracy}


def span_loss(model, batch, training):
    """Mean of the start and end cross-entropies (Devlin et al. 2019, 4.2)."""
    import tensorflow as tf

    from tfgpt.training.train_step import cross_entropy

    inputs, labels = batch
    outputs = model(inputs, training=training)  # (B, T) float32 each
    metrics = {}
    losses = []
    for side in ("start", "end"):
        logits, targets = outputs[f"{side}_logits"], tf.cast(labels[f"{side}_positions"], "int32")
        losses.append(cross_entropy(targets, logits))
        predicted = tf.cast(tf.argmax(logits, -1), "int32")
        correct = tf.cast(tf.equal(predicted, targets), "float32")
        metrics[f"{side}_accuracy"] = tf.reduce_mean(correct)
    return (losses[0] + losses[1]) / 2.0, metrics


# ---- Evaluation -------------------------------------------------------------


def gather_objects(value, distribution):
    """Every worker's `value` (JSON-serialisable), in rank order, on every worker.

    The distribution interface has no allgather, so this is one built from
    `allreduce_mean`: each worker writes its UTF-8 JSON into its own row of
    a zero matrix; the mean over workers times their number is the matrix
    with every row filled. Bytes and lengths are small integers, exact in
    float64. Costs workers x longest payload x 8 bytes of traffic.
    """
    import tensorflow as tf

    workers = distribution.num_workers
    if workers == 1:
        return [value]
    payload = np.frombuffer(json.dumps(value).encode("utf-8"), np.uint8)

    def summed(array):
        mean = distribution.allreduce_mean(tf.constant(array, tf.float64)).numpy()
        return np.rint(mean * workers).astype(np.int64)

    lengths = np.zeros(workers)
    lengths[distribution.rank] = len(payload)
    lengths = summed(lengths)
    table = np.zeros((workers, max(int(lengths.max()), 1)))
    table[distribution.rank, : len(payload)] = payload
    table = summed(table).astype(np.uint8)
    return [json.loads(table[rank, : lengths[rank]].tobytes()) for rank in range(workers)]


def predict_batches(model, inputs, batch_size, xla):
    """Runs `model` over `inputs` (dict of (N, T) arrays); returns NumPy outputs."""
    import tensorflow as tf

    predict = tf.function(lambda batch: model(batch, training=False), jit_compile=xla)
    outputs = []
    for batch in tf.data.Dataset.from_tensor_slices(inputs).batch(batch_size):
        outputs.append(tf.nest.map_structure(lambda t: t.numpy(), predict(batch)))
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)


def evaluate_classification(model, config, tokenizer, validation, labels, distribution):
    """`(predicted labels in file order, metrics)`; each worker predicts its share."""
    from tfgpt.finetuning.classification import encode_classification

    texts, gold = validation
    mine = list(range(distribution.rank, len(texts), distribution.num_workers))
    predicted = []
    if mine:
        inputs = encode_classification(
            [texts[i] for i in mine], tokenizer, config.max_sequence_length
        )
        logits = predict_batches(model, inputs, config.batch_size, config.xla)
        predicted = np.argmax(logits, -1).tolist()
    by_index = {}
    for part in gather_objects([mine, predicted], distribution):
        by_index.update(zip(*part))
    predicted_ids = np.asarray([by_index[i] for i in range(len(texts))])
    correct = int((predicted_ids == gold).sum())
    metrics = {"accuracy": correct / len(texts), "correct": correct, "total": len(texts)}
    return [labels[i] for i in predicted_ids], metrics


def evaluate_squad(model, config, tokenizer, examples, version, distribution):
    """`({question id: answer}, metrics)`; each worker predicts its share of the questions."""
    from tfgpt.finetuning.squad import gold_answers, postprocess_predictions, squad_features
    from tfgpt.finetuning.squad_metrics import squad_scores

    mine = examples[distribution.rank :: distribution.num_workers]
    predictions = {}
    if mine:
        features = squad_features(
            mine,
            tokenizer,
            max_sequence_length=config.max_sequence_length,
            stride=config.doc_stride,
            max_question_length=config.max_query_length,
        )
        outputs = predict_batches(model, features.inputs(), config.batch_size, config.xla)
        predictions = postprocess_predictions(
            mine,
            features,
            outputs["start_logits"],
            outputs["end_logits"],
            n_best=config.n_best,
            max_answer_length=config.max_answer_length,
            allow_no_answer=version == "2.0",
            no_answer_threshold=config.no_answer_threshold,
        )
    gathered = {}
    for part in gather_objects(predictions, distribution):
        gathered.update(part)
    ordered = {example.question_id: gathered[example.question_id] for example in examples}
    scores = squad_scores(gold_answers(examples), ordered, version=version)
    return ordered, {**scores, "version": version}


# ---- The run ----------------------------------------------------------------


def _resolve_steps(config, num_records, global_batch):
    if config.steps:
        return config.steps
    return max(1, int(round(config.epochs * num_records / global_batch)))


def _load_tokenizer(config, resume_directory=None):
    from tfgpt.finetuning.offset_tokenizer import OffsetTokenizer

    source = resume_directory or config.tokenizer or config.init
    return OffsetTokenizer.load(source)


def _copy_tokenizer(tokenizer, out):
    """Copies the tokenizer (and Hugging Face's casing file) into the run directory."""
    from tfgpt.finetuning.offset_tokenizer import TOKENIZER_CONFIG_FILE

    target = os.path.join(out, os.path.basename(tokenizer.path))
    if os.path.abspath(tokenizer.path) != os.path.abspath(target):
        shutil.copyfile(tokenizer.path, target)
    casing = os.path.join(os.path.dirname(tokenizer.path), TOKENIZER_CONFIG_FILE)
    if tokenizer.kind == "wordpiece" and os.path.exists(casing):
        shutil.copyfile(casing, os.path.join(out, TOKENIZER_CONFIG_FILE))


def finetune(config, distribution, model_overrides=None):
    """Fine-tunes and evaluates; returns `(model, metrics)`.

    Args:
        config: FinetuneConfig.
        distribution: a `tfgpt.distributed` object (local, Horovod, a
            tf.distribute strategy).
        model_overrides: dict of BertConfig/AlbertConfig fields set by
            flags (see `parse_flags`).

    Returns:
        The task model and a dict with the last logged training metrics
        (`loss`, `accuracy` of the training batches, ...) and the
        validation metrics with a `val_` prefix (`val_accuracy`, or
        `val_exact_match` and `val_f1`; also in `eval_results.json`,
        unprefixed).
    """
    import keras
    import tensorflow as tf

    from tfgpt.training.checkpointing import Checkpointer, read_config, write_json_atomically
    from tfgpt.training.optimizers import make_optimizer
    from tfgpt.training.precision import slow_precision_warning
    from tfgpt.training.reporter import Reporter
    from tfgpt.training.train_step import TrainStep
    from tfgpt.training.trainer import TrainingDiverged

    model_overrides = dict(model_overrides or {})
    out = config.out

    # Config: resuming takes the architecture and labels from --out.
    has_checkpoint = tf.train.latest_checkpoint(out) is not None
    if has_checkpoint and not config.resume:
        raise ValueError(
            f"--out {out} already holds checkpoints: pass --resume to continue that run, "
            "or choose another --out"
        )
    saved = read_config(out) if has_checkpoint else None
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
    tokenizer = _load_tokenizer(config, out if saved else None)
    train_inputs, train_labels = encode_training_records(config, train, tokenizer)
    num_records = len(train_inputs["token_ids"])
    if num_records < distribution.num_workers:
        raise ValueError(
            f"{config.train_file}: {num_records} training record(s) cannot be split between "
            f"{distribution.num_workers} workers"
        )
    global_batch = config.batch_size * config.accumulation_steps * distribution.size
    steps = _resolve_steps(config, num_records, global_batch)

    # Model: the encoder from --init (or --out when resuming), a new head.
    keras.utils.set_random_seed(config.seed)
    keras.config.set_dtype_policy(_POLICIES[config.mixed_precision])
    with distribution.scope():
        if saved:
            family = saved["family"]
            model_config = _apply_overrides(family, saved["model"], model_overrides, f"--out {out}")
            backbone = _backbone_class(family)(**dataclasses.asdict(model_config))
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
        model = build_task_model(config.task, backbone, len(labels), config.classifier_dropout)
        # Optimizer.
        train_config = config.train_config(steps)
        optimizer = distribution.configure_optimizer(
            make_optimizer(train_config, distribution.size)
        )
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    report = Reporter(out, distribution.is_chief)
    # An explicit --towers wins; 0 takes what the distribution split its threads for.
    towers = config.towers or distribution.towers
    report.info(
        f"tfgpt finetune: {config.task} on a {family} encoder "
        f"({'resumed from ' + out if saved else config.init or 'random ' + config.preset}), "
        f"{distribution.num_workers} worker(s), {distribution.size} replica(s), "
        f"{num_records} training {'records' if config.task == 'classification' else 'windows'}, "
        f"global batch {global_batch}, {steps} steps, "
        f"{towers} tower(s) per replica"
        + (f", labels {labels}" if labels else "")
    )
    warning = slow_precision_warning(config.mixed_precision)
    if warning:
        report.info(f"warning: {warning}")
    report.info(f"model: {model.count_params():,} parameters {model_config}")
    train_step = TrainStep(
        model,
        optimizer,
        distribution,
        loss_fn=classification_loss if config.task == "classification" else span_loss,
        xla=config.xla,
        accumulation_steps=config.accumulation_steps,
        towers=towers,
    )

    # Checkpoints: the trainer core's; dropout state saved beside the model.
    checkpointer = Checkpointer(
        out,
        distribution.is_chief,
        keep=config.keep_checkpoints,
        collective=distribution.saves_collectively,
        rank=distribution.rank,
        model=model,
        optimizer=optimizer,
        step=step,
        rng=[v.value for v in model.variables if "seed_generator_state" in v.path],
    )
    if saved:
        checkpointer.restore_latest()
        report.info(f"resumed from {checkpointer.latest} at step {int(step.numpy())}")
    checkpointer.write_run_files(
        {
            "family": family,
            "task": config.task,
            "model": dataclasses.asdict(model_config),
            "labels": labels,
            "finetune": dataclasses.asdict(config),
            "steps": steps,
            "workers": distribution.num_workers,
            "replicas": distribution.size,
        }
    )
    if distribution.is_chief:
        _copy_tokenizer(tokenizer, out)
    distribution.broadcast_variables(model.variables + optimizer.variables + [step])

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

    def save(at_step, last_loss):
        if not math.isfinite(last_loss):
            raise TrainingDiverged(
                f"loss is {last_loss} at step {at_step}; not saving it over the last "
                f"good checkpoint ({checkpointer.latest})"
            )
        return checkpointer.save(at_step)

    # Loop.
    metrics, mean_loss = {}, float("nan")
    window_start, window_steps, window_sums = time.perf_counter(), 0, {}
    for current in range(start, steps):
        step_metrics = train_step(next(batches))
        step.assign(current + 1)
        window_sums = {
            name: window_sums.get(name, 0.0) + value for name, value in step_metrics.items()
        }
        window_steps += 1
        last = current + 1 == steps
        if (current + 1) % config.log_every == 0 or last or current == 0:
            # The window's means, averaged over workers in one collective.
            names = ["loss"] + sorted(set(window_sums) - {"loss", "gradient_norm"})
            means = distribution.allreduce_mean(
                tf.stack([tf.cast(window_sums[name], tf.float32) for name in names]) / window_steps
            ).numpy()
            mean_loss = float(means[0])
            if not math.isfinite(mean_loss):
                raise TrainingDiverged(
                    f"loss is {mean_loss} at step {current + 1}; stopping without saving "
                    f"(last good checkpoint: {checkpointer.latest})"
                )
            elapsed = time.perf_counter() - window_start
            metrics = {
                "loss": mean_loss,
                "learning_rate": float(optimizer.learning_rate),
                "gradient_norm": float(step_metrics["gradient_norm"]),
                **{name: float(value) for name, value in zip(names[1:], means[1:])},
            }
            # The first window includes tracing: no rate for it.
            if current + 1 - window_steps > start:
                metrics["sequences_per_second"] = global_batch * window_steps / elapsed
            report.scalars(current + 1, metrics)
            window_start, window_steps, window_sums = time.perf_counter(), 0, {}
        if config.save_every and (current + 1) % config.save_every == 0 and not last:
            save(current + 1, float(step_metrics["loss"]))
    if int(step.numpy()) > start or not checkpointer.latest:
        saved_path = save(int(step.numpy()), mean_loss)
        if saved_path:
            report.info(f"saved {saved_path}")

    # Evaluation: every worker predicts its share; all of them see the result.
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
