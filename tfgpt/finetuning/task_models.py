"""The fine-tuned model: the encoder from `--init`, a task head, the task's loss.

Where the encoder comes from (`--init`):

- a tfgpt encoder run directory (`train_hvd.py --preset bert-*|albert-*`,
  or a fine-tuning run): the backbone is built from its `config.json`
  (`family`, `model`) and restored from its latest checkpoint; the
  pretraining heads are not needed and are not restored;
- a Hugging Face BERT/ALBERT directory (`config.json` with `model_type`,
  `model.safetensors`): read by `tfgpt.convert_encoders`;
- nothing (`--init ""`): a randomly initialised `--preset`, with model
  flags overriding it.

Either way only `--dropout` may differ from the architecture found there.
"""

import dataclasses
import json
import os

import tensorflow as tf

from tfgpt.checkpoint import latest, load_weights
from tfgpt.config.models import FAMILIES, FINETUNING_FAMILIES, family_of_preset
from tfgpt.convert_encoders import hf_encoder_config, load_hf_weights
from tfgpt.models.encoder_families import ENCODER_FAMILIES
from tfgpt.models.sequence_classifier import SequenceClassifier
from tfgpt.models.span_question_answerer import SpanQuestionAnswerer
from tfgpt.training.train_step import cross_entropy


def build_backbone_of(family, model_config):
    """A fresh backbone of `family` (`"bert"`, `"albert"`) shaped by `model_config`."""
    return FAMILIES[family].backbone_class()(**dataclasses.asdict(model_config))


def apply_overrides(family, fields, model_overrides, source):
    """Architecture fields from `source`; only `dropout` may be overridden."""
    cls = FAMILIES[family].config_class
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
    if family not in FINETUNING_FAMILIES:
        titles = " or ".join(ENCODER_FAMILIES[name].title for name in FINETUNING_FAMILIES)
        names = " or ".join(repr(name) for name in FINETUNING_FAMILIES)
        raise ValueError(
            f"--init {init} holds a {family!r} model; fine-tuning needs a {titles} "
            f"encoder (family {names})"
        )
    return kind, family, saved


def restore_backbone(backbone, directory):
    """Restores `backbone` from a tfgpt run's latest checkpoint (pretraining or
    fine-tuning, any layout); returns its path.

    Only the backbone is read: the checkpoint's heads, optimizer and step
    are left out. Pretraining and task models keep the encoder as
    `backbone/`. Raises ValueError naming the directory, the variable and
    its shapes when the checkpoint holds another architecture.
    """
    path = latest(directory)
    if path is None:
        raise ValueError(f"--init {directory}: config.json but no checkpoint (ckpt-N)")
    try:
        return load_weights(directory, backbone, prefix="backbone/")
    except ValueError as error:
        raise ValueError(
            f"--init {directory}: {os.path.basename(path)} does not hold the "
            f"{type(backbone).__name__} that its config.json describes (a checkpoint of another "
            f"architecture): {error}"
        ) from None


def build_backbone(config, model_overrides, tokenizer_vocabulary):
    """`(backbone, family, model config)` from `config.init` (see the module docstring)."""
    if not config.init:
        family = family_of_preset(config.preset)
        overrides = dict(model_overrides)
        overrides.setdefault("vocabulary_size", tokenizer_vocabulary)
        model_config = family.config_class.from_preset(config.preset, **overrides)
        return build_backbone_of(family.name, model_config), family.name, model_config
    kind, family, saved = describe_init(config.init)
    if kind == "tfgpt":
        model_config = apply_overrides(
            family, saved["model"], model_overrides, f"--init {config.init}"
        )
        backbone = build_backbone_of(family, model_config)
        restore_backbone(backbone, config.init)
        return backbone, family, model_config
    source = f"--init {config.init}"
    hf_config = hf_encoder_config(saved, os.path.join(config.init, "config.json"))
    model_config = apply_overrides(family, dataclasses.asdict(hf_config), model_overrides, source)
    backbone = build_backbone_of(family, model_config)
    load_hf_weights(backbone, config.init)
    return backbone, family, model_config


def build_task_model(task, backbone, num_classes, classifier_dropout):
    if task == "classification":
        return SequenceClassifier(backbone, num_classes=num_classes, dropout=classifier_dropout)
    return SpanQuestionAnswerer(backbone)


def classification_loss(model, batch, training):
    """Cross-entropy of the class logits, and the batch's accuracy."""
    inputs, labels = batch
    logits = model(inputs, training=training)  # (B, classes) float32
    predicted = tf.cast(tf.argmax(logits, -1), "int32")
    accuracy = tf.reduce_mean(tf.cast(tf.equal(predicted, tf.cast(labels, "int32")), "float32"))
    return cross_entropy(labels, logits), {"accuracy": accuracy}


def span_loss(model, batch, training):
    """Mean of the start and end cross-entropies (Devlin et al. 2019, 4.2)."""
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
