"""What is trained: the model family, its data, its loss and its metrics.

- `clm`: causal language modelling with a GPT on packed token records.
- `sft`: the same on instruction records (`pipelines.prepare --format
  instructions`), learning each example's completion alone: the loss is
  the weighted mean over the learned tokens of the global batch.
- `mlm`, `mlm+nsp`, `mlm+sop`: masked-LM pretraining of BERT, ALBERT or
  RoBERTa (`mlm` only) on encoder records (`pipelines.prepare --format
  encoder`), with dynamic masking and, for the last two, next-sentence or
  sentence-order prediction (`pipelines.encoder_data`). The loss is the
  masked-LM cross-entropy plus the sentence-pair cross-entropy.

The preset names the family (`gpt-*`, `bert-*`, `albert-*`, `roberta-*`);
`--task auto` picks the family's pretraining task (clm, mlm+nsp, mlm+sop,
mlm).
"""

import dataclasses

import numpy as np
import tensorflow as tf

from pipelines import encoder_data, instruction_data, reader
from pipelines.manifest import INSTRUCTION_FORMAT
from tfgpt.config import FAMILIES
from tfgpt.parallel.tensor_parallel import WHOLE
from tfgpt.training.train_step import causal_lm_loss, cross_entropy


def build_model(family, config, dtype=None):
    """The pretraining model of `family` (a name) from its config dataclass."""
    kwargs = dataclasses.asdict(config)
    if dtype is not None:
        kwargs["dtype"] = dtype
    return FAMILIES[family].pretraining_class()(**kwargs)


class CausalLanguageModelling:
    """Next-token prediction on packed records (`input_ids` of seq_len + 1)."""

    name = "clm"
    data_format = reader.PACKED_FORMAT
    token_weights = None  # every target counts alike

    def dataset(self, data_dir, split, batch_size, **options):
        return reader.make_dataset(data_dir, split, batch_size, **options)

    def loss(self, model, batch, training):
        return causal_lm_loss(model, batch, training)

    def evaluation_summary(self, batch, vocabulary_size):
        """Token counts of the targets, for the unigram baseline."""
        _, targets = batch
        return np.bincount(targets.numpy().ravel(), minlength=vocabulary_size)


class InstructionTuning(CausalLanguageModelling):
    """Next-token prediction on instruction records `(inputs, targets, weights)`:
    the completions' tokens learned, the prompts' and the padding not. Packed
    records (`prepare --pack`) add `segment_ids`, which the model takes: each
    example attends within itself, its positions from 0."""

    name = "sft"
    data_format = INSTRUCTION_FORMAT

    def dataset(self, data_dir, split, batch_size, **options):
        return instruction_data.make_instruction_dataset(data_dir, split, batch_size, **options)

    def loss(self, model, batch, training):
        inputs, targets, weights, *segments = batch
        packed = {"segment_ids": segments[0]} if segments else {}
        logits = model(inputs, training=training, **packed)
        return cross_entropy(targets, logits, weights,
                             tensor_slice=getattr(model, "tensor_slice", WHOLE)), {}

    @staticmethod
    def token_weights(batch):
        """The learned targets (`TrainStep`'s `token_weights`, `evaluate`'s)."""
        return batch[2]

    def evaluation_summary(self, batch, vocabulary_size):
        """Token counts of the learned targets, for the unigram baseline."""
        _, targets, weights = batch[:3]
        return np.bincount(targets.numpy()[weights.numpy() > 0], minlength=vocabulary_size)


# The label of each sentence-pair task in the encoder records (pipelines.encoder_data).
_PAIR_LABELS = {"nsp": "next_sentence_label", "sop": "sentence_order_label"}


class MaskedLanguageModelling:
    """Masked-LM (+ next-sentence or sentence-order) pretraining of an encoder.

    Args:
        name: str. "mlm", "mlm+nsp" or "mlm+sop".
        family: str. "bert", "albert" or "roberta".
    """

    data_format = reader.ENCODER_FORMAT
    token_weights = None  # the masked-LM loss weighs its own predictions

    def __init__(self, name, family):
        self.name = name
        self.family = family
        self.pair_task = name.split("+")[1] if "+" in name else None
        # The data always carries a pair label, the family's; plain mlm ignores it.
        # A family without a pair task (RoBERTa) reads the pair as one segment.
        self._one_segment = FAMILIES[family].pair_task is None
        self._data_task = self.pair_task or FAMILIES[family].pair_task or "sop"
        self._pair_label = _PAIR_LABELS[self._data_task]
        self._pair_logits = f"{self._data_task}_logits"  # Bert's nsp_logits, Albert's sop_logits

    def dataset(self, data_dir, split, batch_size, **options):
        dataset = encoder_data.make_encoder_dataset(
            data_dir, split, batch_size, task=self._data_task, **options
        )
        if self._one_segment:
            # RoBERTa has no second segment row: its inputs are one segment.
            dataset = dataset.map(lambda features, labels: (
                {key: value for key, value in features.items() if key != "segment_ids"}, labels))
        return dataset

    def loss(self, model, batch, training):
        features, labels = batch
        outputs = model(features, training=training)
        weights = tf.cast(labels["mask_weights"], "float32")
        mlm_logits = outputs["mlm_logits"]  # (B, P, V) float32
        mlm_loss = cross_entropy(labels["mask_ids"], mlm_logits, weights)
        predicted = tf.cast(tf.argmax(mlm_logits, -1), "int32")
        correct = tf.cast(tf.equal(predicted, tf.cast(labels["mask_ids"], "int32")), "float32")
        metrics = {
            "mlm_loss": mlm_loss,
            "mlm_accuracy": tf.reduce_sum(correct * weights) / tf.maximum(tf.reduce_sum(weights), 1.0),
        }
        loss = mlm_loss
        if self.pair_task:
            pair_logits = outputs[self._pair_logits]  # (B, 2)
            pair_labels = labels[self._pair_label]
            pair_loss = cross_entropy(pair_labels, pair_logits)
            pair_predicted = tf.cast(tf.argmax(pair_logits, -1), "int32")
            metrics[f"{self.pair_task}_loss"] = pair_loss
            metrics[f"{self.pair_task}_accuracy"] = tf.reduce_mean(
                tf.cast(tf.equal(pair_predicted, tf.cast(pair_labels, "int32")), "float32")
            )
            loss = loss + pair_loss
        return loss, metrics

    def evaluation_summary(self, batch, vocabulary_size):
        return None


# The decoder tasks, by name (the others are masked-LM tasks of a family).
TASKS = {task.name: task for task in (CausalLanguageModelling, InstructionTuning)}


def make_task(name, family):
    if name in TASKS:
        return TASKS[name]()
    return MaskedLanguageModelling(name, family)
