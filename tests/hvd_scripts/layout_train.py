"""The real trainer (train_hvd.py's core) on one layout; then each rank writes what it trained.

Usage: layout_train.py OUT TAG TRAIN_FLAGS...   (alone, or under horovodrun)

Trains with TRAIN_FLAGS (their `--out` is the run's directory: its
metrics.jsonl has the losses) and writes OUT/TAG-rank-R.npz: for each
trained variable this rank holds, by its path below the model (`weight/PATH`),
its value as float32, for a tensor slice its split rule (`rule/PATH`), and
in one process its value before the first step (`initial/PATH`); and each
frozen weight it holds (an adapter run's base) as `frozen/PATH`, as it is.
A pipeline rank holds its stage's variables (the tied table on both ends);
under ZeRO stage 3 every rank gathers the whole weights from the shards.
"""

import contextlib
import sys

import numpy as np

from tfgpt.config.distribution import HorovodOptions
from tfgpt.parallel.horovod_bridge import HorovodDistribution
from tfgpt.parallel.tensor_parallel import split_rules
from tfgpt.training import loop
from tfgpt.training.flags import parse_flags
from tfgpt.training.trainer import train


@contextlib.contextmanager
def _parts_kept(parts):
    """Appends the run's `RunPart` to `parts` as the trainer builds it."""
    original = loop.build_model_and_optimizer

    def build(*args, **kwargs):
        part = original(*args, **kwargs)
        # One process: the weights before the first step, to measure how far training moved them.
        if part.distribution.num_workers == 1:
            part.initial = [v.numpy() for v in part.trained.trainable_variables]
        parts.append(part)
        return part

    loop.build_model_and_optimizer = build
    try:
        yield
    finally:
        loop.build_model_and_optimizer = original


def main(argv):
    out, tag, *flags = argv
    train_config, model_overrides, options = parse_flags(flags, options_class=HorovodOptions)
    distribution = HorovodDistribution.create(options, train_config)
    parts = []
    with _parts_kept(parts):
        train(train_config, model_overrides, distribution)
    [part] = parts
    sharding = part.sharding
    variables = list(part.trained.trainable_variables)
    if getattr(sharding, "stage", 0) == 3:  # the variables gave up their storage
        values = sharding.gather_weights()  # collective: every rank of the data group
    else:
        values = [variable.value for variable in variables]
    rules = split_rules(part.model)
    held = part.stage.held_variables if part.stage is not None else part.model.variables
    arrays = {f"frozen/{v.path.split('/', 1)[1]}": v.numpy() for v in held
              if part.base is not None and not v.trainable and "seed_generator" not in v.path}
    for index, (variable, value) in enumerate(zip(variables, values)):
        path = variable.path.split("/", 1)[1]  # below the model's own name (gpt, gpt_1, ...)
        arrays[f"weight/{path}"] = np.asarray(value, np.float32)
        if hasattr(part, "initial"):
            arrays[f"initial/{path}"] = part.initial[index]
        if id(variable) in rules:
            arrays[f"rule/{path}"] = np.asarray(rules[id(variable)])
    np.savez(f"{out}/{tag}-rank-{distribution.rank}.npz", **arrays)


if __name__ == "__main__":
    main(sys.argv[1:])
