"""Tensor-parallel training against one process: run under horovodrun, or alone for the oracle.

Every step has a global batch of GLOBAL_ROWS sequences. Under horovodrun
with `--tensor T`, the N ranks form N / T data replicas, each reading its
rows of the global batch, and each rank trains its slice of a tiny GPT
through `TrainStep`; alone with `--global` (no Horovod), one process
trains the whole model on all of the rows. Both build the model from the
same seed. Writes OUT/<tag>-rank-R.npz: the trainable variables (this
rank's slices) in model order, each one's split rule (`rule_I`, absent
for a replicated variable), the losses (averaged over the ranks), the
gradient norms, and the dropout seed states (`seeds`; `split_seeds` marks
the attention probabilities' dropouts). With `--zero-stage 1`, each
rank's optimizer is built on its shards of its slice (`ZeroSharding` over
the data group), and the file also holds `shapes` (the slice's trainable
variables' shapes, padded with -1) and `slot_elements` (this rank's
elements of both optimizer moments). With `--lora R` the model is frozen
and low-rank adapters of rank R on every projection train alone (their B
set to the same random whole values in both, so that the adapters act
from the first step); `--llama` gives it grouped-query attention and a
gated MLP. With `--overflow-step K` the run is in float16 with loss
scaling, and at step K (from 0) the first rank's slice of the first
feed-forward kernel gets an infinite gradient (one process: the whole
kernel); the file then also holds `iterations`, the updates the optimizer
applied. With `--packed` the global batches are packed instruction rows
(`prepare --pack`'s: several examples to a row, `segment_ids`, learned
flags) trained with `--task sft`'s loss, a weighted mean over the global
batch's learned tokens; `--towers K` cuts each rank's rows into K towers.

Usage: tensor_parallel_train.py OUT TAG [--tensor T] [--global] [--clip C]
[--dropout P] [--untied] [--steps K] [--zero-stage S] [--lora R] [--llama]
[--overflow-step K] [--packed] [--towers K]
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config.training import TrainConfig
from tfgpt.layers.transformer_block import set_recompute
from tfgpt.models.adapters import TARGETS, adapted_layers, add_adapters
from tfgpt.optim.optimizers import make_optimizer
from tfgpt.parallel.tensor_parallel import split_rule, split_rules, take_slice
from tfgpt.parallel.zero import slot_variables
from tfgpt.training.objectives import InstructionTuning
from tfgpt.training.train_step import TrainStep, causal_lm_loss

VOCABULARY = 38
GLOBAL_ROWS = 4
LENGTH = 7


def packed_rows(rng):
    """A global batch of packed rows `(inputs, targets, weights, segment_ids)`, as
    `make_instruction_dataset` reads `prepare --pack`'s records: examples of 2 to 5
    tokens one after another (segments 1, 2, ...), then padding (segment 0); each
    example a prompt of 1 to 3 tokens and its completion, whose tokens alone are
    learned."""
    ids = rng.integers(2, VOCABULARY, (GLOBAL_ROWS, LENGTH + 1))
    segments = np.zeros((GLOBAL_ROWS, LENGTH + 1), "int32")
    learned = np.zeros((GLOBAL_ROWS, LENGTH + 1), "float32")
    for row in range(GLOBAL_ROWS):
        start, example = 0, 1
        while (length := int(rng.integers(2, 6))) <= LENGTH + 1 - start:
            segments[row, start:start + length] = example
            learned[row, start + int(rng.integers(1, length)):start + length] = 1
            start, example = start + length, example + 1
    return (ids[:, :-1].astype("int32"), ids[:, 1:].astype("int32"), learned[:, 1:],
            segments[:, :-1])


def batches_of(index, count, steps, packed=False):
    """Data replica `index` of `count`'s rows of the `steps` global batches
    (`packed`: of `packed_rows`)."""
    rng = np.random.default_rng(1000)
    rows = slice(index * GLOBAL_ROWS // count, (index + 1) * GLOBAL_ROWS // count)
    if packed:
        return [tuple(part[rows] for part in packed_rows(rng)) for _ in range(steps)]
    return [
        tuple(rng.integers(0, VOCABULARY, (GLOBAL_ROWS, LENGTH)).astype("int32")[rows]
              for _ in range(2))
        for _ in range(steps)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--global", dest="global_batch", action="store_true")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--untied", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--overflow-step", type=int, default=-1)
    parser.add_argument("--gptj", action="store_true",
                        help="GPT-J's switches: parallel residual, interleaved partial rotary "
                             "positions, no attention biases, an untied head with a bias")
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--llama", action="store_true",
                        help="Llama's switches: grouped-query attention, a gated SiLU MLP, "
                             "RMS norms, rotary positions, an untied head")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--towers", type=int, default=1)
    args = parser.parse_args(argv)

    if args.global_batch:
        from tfgpt.parallel.local import LocalDistribution

        distribution = LocalDistribution()
    else:
        from tfgpt.parallel.horovod_bridge import HorovodDistribution

        distribution = HorovodDistribution(bucket_mb=0.001, tensor_parallel=args.tensor)
        distribution.configure_devices()
    config = TrainConfig(
        data=args.out, steps=args.steps, learning_rate=0.01, warmup_steps=2,
        weight_decay=0.1, gradient_clip_norm=args.clip, scale_learning_rate=False,
        mixed_precision="float16" if args.overflow_step >= 0 else "off",
    )
    keras.utils.set_random_seed(7)
    keras.config.set_dtype_policy("mixed_float16" if args.overflow_step >= 0 else "float32")
    with distribution.scope():
        gptj = dict(positions="rotary", rotary_fraction=0.5, rotary_interleaved=True,
                    attention_bias=False, output_bias=False, residual="parallel",
                    tie_embeddings=False, lm_head_bias=True) if args.gptj else {}
        llama = dict(num_key_value_heads=2, feedforward="gated", activation="silu", norm="rms",
                     positions="rotary", tie_embeddings=False) if args.llama else {}
        model = GPT(vocabulary_size=VOCABULARY, num_layers=2, num_heads=4, hidden_dim=16,
                    intermediate_dim=24, max_sequence_length=LENGTH, dropout=args.dropout,
                    **{"tie_embeddings": not args.untied, **gptj, **llama})
        if args.lora:
            names = {layer.name for layer in model.sublayers()}
            add_adapters(model, args.lora, 2.0 * args.lora,
                         targets=tuple(t for t in TARGETS if t in names))
    rng = np.random.default_rng(3)
    for layer in adapted_layers(model):  # B: the whole values, this slice's part of them
        rule = split_rule(layer.adapter_b.path) if args.tensor > 1 else None
        size = args.tensor if rule and not args.global_batch else 1
        whole = rng.normal(0, 0.3, (args.lora, layer.units * size)).astype("float32")
        index = distribution.tensor_slice.index if size > 1 else 0
        layer.adapter_b.assign(take_slice(whole, rule, size, index) if size > 1 else whole)
    set_recompute(model, args.recompute)
    optimizer = make_optimizer(config, 1, steps=args.steps)
    zero = None
    if args.zero_stage:
        from tfgpt.parallel.zero import ZeroSharding

        distribution.broadcast_variables(model.variables)
        zero = ZeroSharding(args.zero_stage, model, optimizer, distribution)
    else:
        optimizer.build(model.trainable_variables)
        distribution.broadcast_variables(model.variables + optimizer.variables)
    overflow = tf.Variable(False)
    [kernel] = [v for v in model.weights  # (frozen under --lora)
                if v.path.endswith("block_0/feedforward_intermediate/kernel")]

    task = InstructionTuning() if args.packed else None
    task_loss = task.loss if task else causal_lm_loss

    def loss_fn(model, batch, training):
        loss, metrics = task_loss(model, batch, training)
        # A forced float16 overflow in the first rank's slice alone: every rank must skip.
        blow_up = tf.logical_and(overflow, distribution.rank == 0)
        return loss + tf.where(blow_up, np.inf, 0.0) * tf.reduce_sum(tf.square(kernel)), metrics

    step = TrainStep(model, optimizer, distribution, zero=zero, towers=args.towers,
                     loss_fn=loss_fn if args.overflow_step >= 0 else task_loss,
                     token_weights=task.token_weights if task else None)
    index, count = distribution.data_shard()
    losses, norms = [], []
    for number, batch in enumerate(batches_of(index, count, args.steps, args.packed)):
        overflow.assign(number == args.overflow_step)
        metrics = step(batch)
        losses.append(float(distribution.allreduce_mean(metrics["loss"])))
        norms.append(float(metrics["gradient_norm"]))
    rules = split_rules(model)
    variables = model.trainable_variables
    states = [v for v in model.variables if "seed_generator_state" in v.path]
    # The attention probabilities' dropouts: the split regions.
    split_states = {id(block.attention.attention_dropout.seed_generator.state)
                    for block in model.blocks if args.dropout}
    slots = slot_variables(optimizer)
    # Whole weights: ZeRO's gathered from the ranks' shards (stage 3 holds no other).
    values = [np.asarray(w) for w in zero.gather_weights()] if zero else [
        v.numpy() for v in variables]
    np.savez(
        f"{args.out}/{args.tag}-rank-{distribution.rank}.npz",
        shapes=np.array([list(v.shape) + [-1] * (3 - len(v.shape)) for v in variables]),
        slot_elements=sum(int(np.prod(v.shape)) for kind in slots.values() for v in kind),
        losses=np.array(losses), norms=np.array(norms),
        iterations=int(getattr(optimizer, "inner_optimizer", optimizer).iterations.numpy()),
        seeds=np.array([v.numpy() for v in states]),
        split_seeds=np.array([id(v) in split_states for v in states], bool),
        **{f"weight_{i}": value for i, value in enumerate(values)},
        **{f"rule_{i}": np.array(rules[id(v)]) for i, v in enumerate(variables)
           if id(v) in rules},
    )


if __name__ == "__main__":
    main()
