"""The training loop every front end runs: one core, different distributions.

`train()` takes a TrainConfig, model overrides and a distribution object
(`tfgpt.distributed`) and runs, in order: config, data, model, optimizer,
loop, save. The front ends (`train_hvd.py`, `train_mirrored.py`, a
notebook) only choose the distribution.
"""

import dataclasses
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

from pipelines import reader
from pipelines.tokenizer import Tokenizer
from tfgpt.config import GPTConfig
from tfgpt.models.gpt import GPT
from tfgpt.training.checkpointing import TOKENIZER_FILE, Checkpointer, read_config
from tfgpt.training.optimizers import make_optimizer
from tfgpt.training.reporter import Reporter
from tfgpt.training.train_step import EvalStep, TrainStep

_POLICIES = {"off": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def resolve_model_config(train_config, model_overrides, manifest, tokenizer):
    """Returns the GPTConfig for this run: preset, then flags, then the data's facts.

    The vocabulary size comes from the data's tokenizer unless a flag sets
    it; a flag that contradicts the data is an error.
    """
    overrides = dict(model_overrides)
    overrides.setdefault("vocabulary_size", tokenizer.vocabulary_size)
    config = GPTConfig.from_preset(train_config.preset, **overrides)
    if config.vocabulary_size < tokenizer.vocabulary_size:
        raise ValueError(
            "`vocabulary_size` is smaller than the data's tokenizer. Received: "
            f"vocabulary_size={config.vocabulary_size}, tokenizer has "
            f"{tokenizer.vocabulary_size} ids ({train_config.data})"
        )
    sequence_length = manifest["seq_len"]
    if sequence_length > config.max_sequence_length:
        raise ValueError(
            "The data's sequences are longer than the model's context. Received: "
            f"seq_len={sequence_length} in {train_config.data}, "
            f"max_sequence_length={config.max_sequence_length}"
        )
    return config


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


def evaluate(model_step, dataset, distribution, max_batches, vocabulary_size):
    """Mean validation loss over all workers, and the unigram baseline.

    Each worker reads its own part of the split; sums and counts are
    averaged across workers so the result weights every batch equally.
    """
    total, batches = 0.0, 0
    counts = np.zeros(vocabulary_size, np.int64)
    for inputs, targets in dataset:
        total += float(model_step(inputs, targets))
        counts += np.bincount(targets.numpy().ravel(), minlength=vocabulary_size)
        batches += 1
        if max_batches and batches >= max_batches:
            break
    summed = distribution.allreduce_mean(tf.constant([total, float(batches)], tf.float64))
    summed_counts = distribution.allreduce_mean(tf.constant(counts, tf.float64))
    if float(summed[1]) == 0:
        raise ValueError("the validation split has no full batch for this batch size")
    return float(summed[0] / summed[1]), unigram_entropy(summed_counts.numpy())


def train(train_config, model_overrides, distribution):
    """Trains a GPT as `train_config` says; returns `(model, metrics)`.

    Args:
        train_config: TrainConfig.
        model_overrides: dict of GPTConfig fields set explicitly by flags.
        distribution: a `tfgpt.distributed` object (local, Horovod, ...).
    """
    # Config: from the preset, the flags, and the data's manifest.
    manifest = reader.load_manifest(train_config.data)
    tokenizer_path = os.path.join(train_config.data, TOKENIZER_FILE)
    tokenizer = Tokenizer.load(tokenizer_path)
    if train_config.resume and os.path.exists(os.path.join(train_config.out, "config.json")):
        # Resuming takes the architecture from the checkpoint, not the flags.
        model_overrides = {**read_config(train_config.out)["model"], **model_overrides}
    model_config = resolve_model_config(train_config, model_overrides, manifest, tokenizer)
    out = train_config.out
    report = Reporter(out, distribution.is_chief)
    checkpoint_exists = tf.train.latest_checkpoint(out) is not None
    if checkpoint_exists and not train_config.resume:
        raise ValueError(
            f"--out {out} already holds checkpoints: pass --resume to continue "
            "that run, or choose another --out"
        )
    sequence_length = manifest["seq_len"]
    world_batch = train_config.batch_size * distribution.size
    report.info(
        f"tfgpt: {distribution.size} worker(s), global batch {world_batch} x "
        f"{sequence_length} tokens, {train_config.steps} steps, "
        f"precision {train_config.mixed_precision}, xla {train_config.xla}"
    )

    # Model: identical initial weights everywhere (seeded, then broadcast).
    keras.utils.set_random_seed(train_config.seed)
    keras.config.set_dtype_policy(_POLICIES[train_config.mixed_precision])
    model = GPT(**dataclasses.asdict(model_config))
    report.info(f"model: {model.count_params():,} parameters {model_config}")

    # Optimizer.
    optimizer = make_optimizer(train_config, distribution.size)
    optimizer.build(model.trainable_variables)
    train_step = TrainStep(model, optimizer, distribution, xla=train_config.xla)

    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    checkpointer = Checkpointer(
        out,
        distribution.is_chief,
        keep=train_config.keep_checkpoints,
        model=model,
        optimizer=optimizer,
        step=step,
    )
    resumed_from = checkpointer.restore_latest() if train_config.resume else None
    if resumed_from:
        report.info(f"resumed from {resumed_from} at step {int(step)}")
    checkpointer.write_run_files(
        {
            "model": dataclasses.asdict(model_config),
            "train": dataclasses.asdict(train_config),
            "data": {"seq_len": sequence_length, "directory": os.path.abspath(train_config.data)},
            "workers": distribution.size,
        },
        tokenizer_path=tokenizer_path,
    )
    # Keras 3 creates the optimizer's slots in build(), so rank 0's full
    # state can be broadcast before the first step (Horovod's TF1-era
    # examples had to wait until after it for the slots to exist).
    distribution.broadcast_variables(model.variables + optimizer.variables + [step])

    # Data: each worker reads its own part; a resumed run reshuffles with a
    # different seed rather than replaying the batches it already saw.
    start = int(step)
    dataset = reader.make_dataset(
        train_config.data,
        "train",
        train_config.batch_size,
        seed=train_config.seed + start,
        num_shards=distribution.size,
        shard_index=distribution.rank,
    )

    # Loop.
    tokens_per_step = world_batch * sequence_length
    metrics = {}
    window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
    iterator = batches_naming_bad_shards(dataset, train_config.data, "train")
    for current in range(start, train_config.steps):
        inputs, targets = next(iterator)
        loss, gradient_norm = train_step(inputs, targets)
        step.assign(current + 1)
        window_loss += loss
        window_steps += 1
        last = current + 1 == train_config.steps
        if (current + 1) % train_config.log_every == 0 or last or current == start:
            mean_loss = float(distribution.allreduce_mean(window_loss / window_steps))
            if not math.isfinite(mean_loss):
                raise TrainingDiverged(
                    f"loss is {mean_loss} at step {current + 1}; nothing was saved "
                    f"after the last good checkpoint ({checkpointer.latest})"
                )
            elapsed = time.perf_counter() - window_start
            metrics = {
                "loss": mean_loss,
                "perplexity": math.exp(min(mean_loss, 50.0)),
                "learning_rate": float(optimizer.learning_rate),
                "gradient_norm": float(gradient_norm),
            }
            # The first step includes tracing and compilation: no rate for it.
            if current > start:
                metrics["tokens_per_second"] = tokens_per_step * window_steps / elapsed
            report.scalars(current + 1, metrics)
            window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
        if train_config.save_every and (current + 1) % train_config.save_every == 0 and not last:
            checkpointer.save(current + 1)
    saved = checkpointer.save(int(step))
    if saved:
        report.info(f"saved {saved}")

    # Validation.
    validation = reader.make_dataset(
        train_config.data,
        "val",
        train_config.batch_size,
        shuffle=False,
        repeat=False,
        num_shards=distribution.size,
        shard_index=distribution.rank,
    )
    val_loss, baseline = evaluate(
        EvalStep(model, xla=train_config.xla),
        batches_naming_bad_shards(validation, train_config.data, "val"),
        distribution,
        train_config.eval_batches,
        model_config.vocabulary_size,
    )
    metrics.update(val_loss=val_loss, unigram_entropy=baseline)
    report.scalars(int(step), {"loss": val_loss, "unigram_entropy": baseline}, prefix="val")
    report.info(
        f"validation loss {val_loss:.4f} nats/token (perplexity {math.exp(val_loss):.1f}); "
        f"unigram baseline {baseline:.4f}"
    )
    report.close()
    return model, metrics
