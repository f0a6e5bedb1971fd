"""ZeRO against whole-state training: run under horovodrun, or alone for the oracle.

Every step has a global batch of GLOBAL_ROWS sequences; each of N ranks
trains a tiny GPT on its 1/N of the rows through `TrainStep` with ZeRO
stage S (0: whole state), or one process (`--global`, no Horovod) on all
of them. Writes OUT/<tag>-rank-R.npz with the final whole weights (in
model order), the losses (averaged over the ranks), the gradient norms
and the optimizer's iteration count.

`--gather-order` (stage 3) traces one step's forward and backward pass
instead of training and writes OUT/<tag>-rank-R.json: for each all-gather
op in the graph, how many other all-gathers it depends on (data or control,
transitively).

`--stop-at K --checkpoint DIR` saves a checkpoint at step K in DIR and
stops; `--checkpoint DIR` alone resumes from DIR's latest (whatever world
size or stage wrote it) and trains to STEPS.

Usage: zero_check.py OUT TAG [--stage S] [--global] [--optimizer
adamw|lamb] [--accumulation K] [--clip C] [--recompute] [--precision
off|bfloat16|float16] [--overflow-step K] [--towers K] [--xla] [--checkpoint DIR
[--stop-at K]] [--gather-order]
"""

import argparse
import json
import types

import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config.training import TrainConfig
from tfgpt.layers.transformer_block import set_recompute
from tfgpt.optim.optimizers import make_optimizer
from tfgpt.training import loop
from tfgpt.training.loop import POLICIES
from tfgpt.training.train_step import TrainStep, cross_entropy

STEPS = 6
VOCABULARY = 37
GLOBAL_ROWS = 12  # per micro-batch: 6 per rank on 2, 4 on 3
LENGTH = 7


def batches_of(rank, size, accumulation):
    """This rank's rows of the STEPS global batches; (K, B, T) with accumulation K > 1."""
    rng = np.random.default_rng(1000)
    shape = (accumulation, GLOBAL_ROWS, LENGTH) if accumulation > 1 else (GLOBAL_ROWS, LENGTH)
    rows = slice(rank * GLOBAL_ROWS // size, (rank + 1) * GLOBAL_ROWS // size)
    cut = (lambda a: a[:, rows]) if accumulation > 1 else (lambda a: a[rows])
    return [
        tuple(cut(rng.integers(0, VOCABULARY, shape).astype("int32")) for _ in range(2))
        for _ in range(STEPS)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--global", dest="global_batch", action="store_true")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--precision", default="off")
    parser.add_argument("--overflow-step", type=int, default=-1)
    parser.add_argument("--towers", type=int, default=1)
    parser.add_argument("--xla", action="store_true")
    parser.add_argument("--checkpoint")
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--gather-order", action="store_true")
    args = parser.parse_args(argv)

    if args.global_batch:
        from tfgpt.parallel.local import LocalDistribution

        distribution = LocalDistribution()
    else:
        from tfgpt.parallel.horovod_bridge import HorovodDistribution

        distribution = HorovodDistribution(bucket_mb=0.001,  # several buckets
                                           zero_stage=args.stage)
        distribution.configure_devices()
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
    # The run core's part: ZeroSharding at --stage 1-3, Unsharded at 0.
    step_variable = tf.Variable(0, dtype=tf.int64)
    part = loop.RunPart(model, optimizer, step_variable, distribution)
    zero = part.sharding

    overflow = tf.Variable(False)

    def loss_fn(model, batch, training):
        inputs, targets = batch
        loss = cross_entropy(targets, model(inputs, training=training))
        # A forced float16 overflow on rank 0 only: every rank must skip.
        blow_up = tf.logical_and(overflow, distribution.rank == 0)
        return loss * tf.where(blow_up, np.float32(np.inf), np.float32(1.0)), {}

    step = TrainStep(model, optimizer, distribution, loss_fn=loss_fn,
                     accumulation_steps=args.accumulation, towers=args.towers, zero=zero,
                     xla=args.xla)
    batches = batches_of(distribution.rank, distribution.size, args.accumulation)
    if args.gather_order:
        graph = tf.function(step._forward_backward_fn).get_concrete_function(batches[0]).graph
        with open(f"{args.out}/{args.tag}-rank-{distribution.rank}.json", "w") as file:
            json.dump(gathers_before(graph), file)
        return
    start, checkpointer = 0, None
    if args.checkpoint:
        checkpointer = part.checkpointer(
            types.SimpleNamespace(out=args.checkpoint, keep_checkpoints=2))
        if not args.stop_at:
            checkpointer.restore_latest()
            start = int(step_variable.numpy())
    losses, norms = [], []
    for index in range(start, args.stop_at or STEPS):
        overflow.assign(index == args.overflow_step)
        metrics = step(batches[index])
        losses.append(float(distribution.allreduce_mean(metrics["loss"])))
        norms.append(float(metrics["gradient_norm"]))
    if args.stop_at:
        step_variable.assign(args.stop_at)
        checkpointer.save(args.stop_at)
    weights = ([w.numpy() for w in zero.gather_weights()] if args.stage
               else [v.numpy() for v in model.trainable_variables])
    iterations = int(getattr(optimizer, "inner_optimizer", optimizer).iterations.numpy())
    np.savez(
        f"{args.out}/{args.tag}-rank-{distribution.rank}.npz",
        losses=np.array(losses), norms=np.array(norms), iterations=iterations, start=start,
        **{f"weight_{i}": w for i, w in enumerate(weights)},
    )


def gathers_before(graph):
    """{all-gather op name: how many other all-gathers it depends on}."""
    gathers = [op for op in graph.get_operations() if "Allgather" in op.type]
    found = {}
    for gather in gathers:
        seen, frontier = set(), [gather]
        while frontier:
            op = frontier.pop()
            for parent in [t.op for t in op.inputs] + list(op.control_inputs):
                if parent.name not in seen:
                    seen.add(parent.name)
                    frontier.append(parent)
        found[gather.name] = sum(other.name in seen for other in gathers)
    return found


if __name__ == "__main__":
    main()
