"""Fine-tuning data: the task files, read and checked, then encoded into batches.

The files are read before any model is built, so that a bad label or an
answer outside its context is an error naming the file and line (or the
question id) at once. The tokenizer is the init directory's
(`tokenizer.model`, `spiece.model` or `vocab.txt`) unless `--tokenizer`
names one; see `tfgpt.finetuning.offset_tokenizer`.
"""

import os
import shutil

import tensorflow as tf

from tfgpt.finetuning.classification import (
    encode_classification,
    read_classification_file,
    read_records,
)
from tfgpt.finetuning.offset_tokenizer import TOKENIZER_CONFIG_FILE, OffsetTokenizer
from tfgpt.finetuning.squad import read_squad, squad_features


def infer_labels(path):
    """The distinct labels of a classification file, sorted (see `FinetuneConfig.labels`)."""
    labels = sorted({label for _, _, label in read_records(path)})
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
    if config.task == "classification":
        texts, label_ids = train
        return encode_classification(texts, tokenizer, config.max_sequence_length), label_ids
    features = squad_windows(train, tokenizer, config)
    labels = {"start_positions": features.start_positions, "end_positions": features.end_positions}
    return features.inputs(), labels


def squad_windows(examples, tokenizer, config):
    """SQuAD features of `examples`: each context cut into windows of `config`'s sizes."""
    return squad_features(
        examples,
        tokenizer,
        max_sequence_length=config.max_sequence_length,
        stride=config.doc_stride,
        max_question_length=config.max_query_length,
    )


def training_dataset(inputs, labels, config, input_context, seed, skip=0):
    """This worker's endless stream of training batches.

    The records are split between workers by index (record i goes to
    input pipeline i mod pipelines) before any shuffle, so together the
    workers read every record once per epoch. With `shuffle` off and an
    even split, step k of N workers sees the same records as step k of one
    worker with an N times larger batch, which the tests rely on.
    """
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


def load_tokenizer(config, resume_directory=None):
    """The tokenizer of `resume_directory`, else of `config.tokenizer`, else of `config.init`."""
    source = resume_directory or config.tokenizer or config.init
    return OffsetTokenizer.load(source)


def copy_tokenizer(tokenizer, out):
    """Copies the tokenizer (and Hugging Face's casing file) into the run directory."""
    target = os.path.join(out, os.path.basename(tokenizer.path))
    if os.path.abspath(tokenizer.path) != os.path.abspath(target):
        shutil.copyfile(tokenizer.path, target)
    casing = os.path.join(os.path.dirname(tokenizer.path), TOKENIZER_CONFIG_FILE)
    if tokenizer.kind == "wordpiece" and os.path.exists(casing):
        shutil.copyfile(casing, os.path.join(out, TOKENIZER_CONFIG_FILE))
