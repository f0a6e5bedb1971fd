"""ZeRO against whole-state training: run under horovodrun, or alone for the oracle.

Each rank trains a tiny GPT for STEPS steps on its own batches through
`TrainStep`, with `--zero-stage` S (0: whole state); run as one process
with `--global`, it trains on every rank's batches at once (the global
batch). Writes OUT/<tag>-rank-R.npz with the final whole weights (in
model order), the losses and the gradient norms.

Usage: zero_check.py OUT TAG --stage S [--ranks N] [--global] [--optimizer
adamw|lamb] [--accumulation K] [--clip C] [--recompute] [--precision
off|bfloat16|float16] [--overflow-step K] [--towers K]
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config.training import TrainConfig
from tfgpt.layers.transformer_block import set_recompute
from tfgpt.training.loop import POLICIES
from tfgpt.training.optimizers import make_optimizer
from tfgpt.training.train_step import TrainStep, cross_entropy

STEPS = 6
VOCABULARY = 37
BATCH = 2  # per rank and micro-batch
LENGTH = 7


def batches_of(rank, accumulation):
    """Rank `rank`'s STEPS batches, (K, B, T) with accumulation K > 1."""
    rng = np.random.default_rng(1000 + rank)
    shape = (accumulation, BATCH, LENGTH) if accumulation > 1 else (BATCH, LENGTH)
    return [
        (rng.integers(0, VOCABULARY, shape).astype("int32"),
         rng.integers(0, VOCABULARY, shape).astype("int32"))
        for _ in range(STEPS)
    ]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=2, help="with --global: whose data")
    parser.add_argument("--global", dest="global_batch", action="store_true")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--precision", default="off")
    parser.add_argument("--overflow-step", type=int, default=-1)
    parser.add_argument("--towers", type=int, default=1)
    args = parser.parse_args()

    if args.global_batch:
        from tfgpt.distributed.local import LocalDistribution

        distribution = LocalDistribution()
    else:
        from tfgpt.distributed.horovod_bridge import HorovodDistribution

        distribution = HorovodDistribution(bucket_mb=0.001)  # several buckets
        distribution.configure_devices()
        distribution.zero_stage = args.stage
    config = TrainConfig(
        data=args.out, steps=STEPS, learning_rate=0.01, warmup_steps=2, optimizer=args.optimizer,
        weight_decay=0.1, gradient_clip_norm=args.clip, mixed_precision=args.precision,
        scale_learning_rate=False, accumulation_steps=args.accumulation,
    )
    keras.utils.set_random_seed(7)
    keras.config.set_dtype_policy(POLICIES[args.precision])
    model = GPT(vocabulary_size=VOCABULARY, num_layers=3, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=LENGTH, dropout=0.0)
    if args.recompute:
        set_recompute(model, True)
    optimizer = make_optimizer(config, 1, steps=STEPS)
    zero = None
    if args.stage:
        from tfgpt.distributed.zero import ZeroSharding

        distribution.broadcast_variables(model.variables)
        zero = ZeroSharding(args.stage, model, optimizer, distribution)
    else:
        optimizer.build(model.trainable_variables)

    overflow = tf.Variable(False)

    def loss_fn(model, batch, training):
        inputs, targets = batch
        loss = cross_entropy(targets, model(inputs, training=training))
        # A forced float16 overflow on rank 0 only: every rank must skip.
        blow_up = tf.logical_and(overflow, distribution.rank == 0)
        return loss * tf.where(blow_up, np.float32(np.inf), np.float32(1.0)), {}

    step = TrainStep(model, optimizer, distribution, loss_fn=loss_fn,
                     accumulation_steps=args.accumulation, towers=args.towers, zero=zero)
    if args.global_batch:
        per_rank = [batches_of(rank, args.accumulation) for rank in range(args.ranks)]
        axis = 1 if args.accumulation > 1 else 0
        batches = [
            tuple(np.concatenate([rank[index][part] for rank in per_rank], axis=axis)
                  for part in (0, 1))
            for index in range(STEPS)
        ]
    else:
        batches = batches_of(distribution.rank, args.accumulation)
    losses, norms = [], []
    for index, batch in enumerate(batches):
        overflow.assign(index == args.overflow_step)
        metrics = step(batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["gradient_norm"]))
    weights = ([w.numpy() for w in zero.gather_weights()] if zero
               else [v.numpy() for v in model.trainable_variables])
    iterations = int(getattr(optimizer, "inner_optimizer", optimizer).iterations.numpy())
    np.savez(
        f"{args.out}/{args.tag}-rank-{distribution.rank}.npz",
        losses=np.array(losses), norms=np.array(norms), iterations=iterations,
        **{f"weight_{i}": w for i, w in enumerate(weights)},
    )


if __name__ == "__main__":
    main()
