"""Pipeline parallelism against one process: run under horovodrun, or alone for the oracle.

Every step has a global batch of `--rows` sequences (ROWS by default).
Under horovodrun each rank is one stage (of `--stages`) of a tiny GPT (`PipelineStage`,
`PipelineTrainStep`, the layout and process sets of `HorovodDistribution`);
each pipeline trains on its rows of the batch (all of them with one
pipeline) in `--microbatches` micro-batches; with
`--global` one process trains the whole model on the same batches
through `TrainStep`. The pipeline's model is built as the trainer builds
it: every variable unallocated but those of the rank's stage
(`tfgpt.parallel.unallocated`). Writes OUT/<tag>-rank-R.npz: the final
weights this rank holds (`weight_I`, I the variable's place in the whole
model's trainable variables), the losses and the gradient norms. With
`--zero-stage 1` each rank's optimizer is built on its shards of its
stage's variables (`ZeroSharding` over the stage's data group), and the
file also holds `shapes` (the stage's trained variables' shapes, padded
with -1) and `slot_elements` (this rank's elements of both optimizer
moments).
With `--tensor T` the stages' blocks are split over
T ranks each as well (`HorovodDistribution`'s layout, data x pipeline x
tensor): the weights are this rank's slices, with their split rules
(`rule_I`, absent for a replicated variable). With `--precision float16`
(loss scaling) and `--overflow-step K`, at step K (from 0) the first
stage's gradients alone are made infinite (one process: all of them), and
the file also holds `iterations`, the updates the optimizer applied.
With `--weighted` each batch also holds token weights (0 or 1, each row
learning a different share of its tokens, so micro-batches and replicas
hold unequal numbers of learned tokens), `--task sft`'s batches: the loss
is the weighted mean over the global batch's learned tokens
(`objectives.InstructionTuning`).

Usage: pipeline_check.py OUT TAG [--global] [--schedule gpipe|1f1b|interleaved]
[--microbatches M] [--stages P] [--virtual-stages V] [--partition uniform|balanced]
[--clip C] [--dropout R] [--untied] [--layers L] [--die-at-step K]
[--precision off|bfloat16|float16] [--overflow-step K] [--zero-stage S] [--rows R]
[--tensor T] [--vocabulary V] [--recompute] [--family NAME] [--weighted]
"""

import argparse
import contextlib
import os

import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config.training import TrainConfig
from tfgpt.layers.transformer_block import set_recompute
from tfgpt.optim.optimizers import make_optimizer
from tfgpt.parallel.tensor_parallel import split_rules
from tfgpt.parallel.unallocated import allocated, build_unallocated
from tfgpt.parallel.zero import slot_variables
from tfgpt.training.loop import POLICIES

STEPS = 6
VOCABULARY = 37
ROWS = 12
LENGTH = 7
# Each family's switches on the tiny model (`--family`), the windows under LENGTH:
# GPT-J's parallel residual, interleaved partial rotary positions, no attention
# biases and an untied head with a bias; GPT-Neo's unscaled scores and local
# attention in every other block; Pythia's parallel residual through two norms
# and split-halves partial rotary positions; Llama's (RMSNorm, rotary, SwiGLU,
# no output or feed-forward biases) with 4 query heads sharing 2 key-value
# heads: Qwen2's with query, key and value biases and a tied head, Mistral's
# with a sliding window, no attention biases and an untied head.
LLAMA = dict(num_heads=4, num_key_value_heads=2, norm="rms", positions="rotary",
             feedforward="gated", activation="silu", output_bias=False, feedforward_bias=False)
FAMILIES = {
    "gpt2": {},
    "gptj": dict(positions="rotary", rotary_fraction=0.5, rotary_interleaved=True,
                 attention_bias=False, output_bias=False, residual="parallel",
                 tie_embeddings=False, lm_head_bias=True),
    "gpt-neo": dict(attention_bias=False, scale_attention=False, sliding_window=4,
                    window_layers="odd"),
    "pythia": dict(positions="rotary", rotary_fraction=0.5, residual="parallel_two_norms",
                   tie_embeddings=False),
    "qwen2": dict(LLAMA, attention_bias=True),
    "mistral": dict(LLAMA, attention_bias=False, sliding_window=4, tie_embeddings=False),
}


def batches(rows=ROWS, vocabulary=VOCABULARY, weighted=False):
    rng = np.random.default_rng(1000)
    data = [tuple(rng.integers(0, vocabulary, (rows, LENGTH)).astype("int32") for _ in range(2))
            for _ in range(STEPS)]
    if not weighted:
        return data
    shares = np.linspace(0.1, 0.9, rows)[:, np.newaxis]  # (rows, 1): row r learns about this
    return [(*batch, (rng.random((rows, LENGTH)) < shares).astype("float32")) for batch in data]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--global", dest="global_batch", action="store_true")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--virtual-stages", type=int, default=1)
    parser.add_argument("--partition", default="uniform")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--untied", action="store_true")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gpt2",
                        help="the family's switches on the tiny model (FAMILIES)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--die-at-step", type=int, default=0)
    parser.add_argument("--precision", default="off")
    parser.add_argument("--overflow-step", type=int, default=-1)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--vocabulary", type=int, default=VOCABULARY)
    parser.add_argument("--weighted", action="store_true")
    args = parser.parse_args(argv)

    if not args.global_batch:
        # Before TensorFlow starts: it sets the threads.
        from tfgpt.config.distribution import HorovodOptions
        from tfgpt.parallel.horovod_bridge import HorovodDistribution

        distribution = HorovodDistribution.create(HorovodOptions(
            pipeline_parallel=args.stages, microbatches=args.microbatches,
            pipeline_schedule=args.schedule, virtual_stages=args.virtual_stages,
            pipeline_partition=args.partition, zero_stage=args.zero_stage,
            tensor_parallel=args.tensor,
        ))
    config = TrainConfig(
        data=args.out, steps=STEPS, learning_rate=0.01, warmup_steps=2, weight_decay=0.1,
        gradient_clip_norm=args.clip, scale_learning_rate=False,
        mixed_precision=args.precision,
    )
    keras.utils.set_random_seed(7)
    keras.config.set_dtype_policy(POLICIES[args.precision])

    def build():
        return GPT(vocabulary_size=args.vocabulary, num_layers=args.layers,
                   hidden_dim=8, intermediate_dim=12, max_sequence_length=LENGTH,
                   dropout=args.dropout,
                   **{"num_heads": 2, "tie_embeddings": not args.untied,
                      **FAMILIES[args.family]})

    with contextlib.nullcontext() if args.global_batch else distribution.scope():
        model = build() if args.global_batch else build_unallocated(build)
    set_recompute(model, args.recompute)
    optimizer = make_optimizer(config, 1, steps=STEPS)
    rank = 0
    data = batches(args.rows, args.vocabulary, args.weighted)
    if args.global_batch:
        from tfgpt.parallel.local import LocalDistribution
        from tfgpt.training.objectives import InstructionTuning
        from tfgpt.training.train_step import TrainStep

        optimizer.build(model.trainable_variables)
        weighted = dict(loss_fn=InstructionTuning().loss,
                        token_weights=InstructionTuning.token_weights) if args.weighted else {}
        step = TrainStep(model, optimizer, LocalDistribution(), **weighted)
        variables = model.trainable_variables
    else:
        from tfgpt.parallel.pipeline_executor import PipelineTrainStep
        from tfgpt.parallel.pipeline_schedule import PipelineSchedule
        from tfgpt.parallel.pipeline_stage import PipelineStage

        state = distribution.state
        rank = distribution.rank
        schedule = PipelineSchedule(args.schedule, args.stages, args.microbatches,
                                    args.virtual_stages)
        stage = PipelineStage(model, schedule, state.stage, partition=args.partition,
                              sequence_length=LENGTH)
        zero = None
        if args.zero_stage:
            from tfgpt.parallel.zero import ZeroSharding

            zero = ZeroSharding(args.zero_stage, model, optimizer, distribution,
                                variables=stage.trainable_variables)
        else:
            optimizer.build(stage.trainable_variables)
        step = PipelineTrainStep(stage, optimizer, distribution.pipeline_process_set,
                                 distribution.data_process_set, zero=zero)
        variables = model.trainable_variables
        # Each pipeline (data-parallel replica) trains on its rows of the batch.
        rows = slice(state.data_index * args.rows // state.data,
                     (state.data_index + 1) * args.rows // state.data)
        data = [tuple(part[rows] for part in batch) for batch in data]
    overflow = tf.Variable(False)

    def blown_up(gradients):
        factor = tf.where(overflow, np.float32(np.inf), np.float32(1.0))
        return [g * factor for g in gradients]

    if args.overflow_step >= 0:
        # A forced float16 overflow in the first stage's gradients alone: every stage must skip.
        if args.global_batch:
            apply = step.sharding.apply

            def overflowing(gradients, *args, **kwargs):
                return apply(blown_up(gradients), *args, **kwargs)

            step.sharding.apply = overflowing
        else:
            sum_tied_table = step._sum_tied_table

            def overflowing(gradients):
                gradients = sum_tied_table(gradients)
                return blown_up(gradients) if stage.rank == 0 else gradients

            step._sum_tied_table = overflowing
    losses, norms = [], []
    for index, batch in enumerate(data):
        if args.die_at_step and index + 1 == args.die_at_step and rank == 1:
            os._exit(3)  # a peer that dies mid-run
        overflow.assign(index == args.overflow_step)
        metrics = step(batch)
        loss = metrics["loss"]
        if not args.global_batch:  # each pipeline's loss is that of its rows
            loss = distribution.allreduce_mean(loss)
        losses.append(float(loss))
        norms.append(float(metrics["gradient_norm"]))
    trained = model.trainable_variables if args.global_batch else stage.trainable_variables
    slots = slot_variables(optimizer)
    rules = split_rules(model)
    np.savez(
        f"{args.out}/{args.tag}-rank-{rank}.npz", losses=np.array(losses), norms=np.array(norms),
        shapes=np.array([list(v.shape) + [-1] * (3 - len(v.shape)) for v in trained]),
        slot_elements=sum(int(np.prod(v.shape)) for kind in slots.values() for v in kind),
        iterations=int(getattr(optimizer, "inner_optimizer", optimizer).iterations.numpy()),
        **{f"weight_{i}": v.numpy() for i, v in enumerate(variables) if allocated(v)},
        **{f"rule_{i}": np.array(rules[id(v)]) for i, v in enumerate(variables)
           if id(v) in rules},
    )


if __name__ == "__main__":
    main()
