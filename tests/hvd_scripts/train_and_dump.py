"""Run under horovodrun: the real trainer core, then each rank dumps what it holds.

Usage: train_and_dump.py OUT_NPZ_DIR TRAIN_FLAGS...
Each rank writes OUT/rank-R.npz with its final weights and the first
batch its data shard yields, so the test can check that ranks read
different data and still end with identical weights.
"""

import sys

import numpy as np

from tfgpt.config import family_of_preset
from tfgpt.config.distribution import HorovodOptions
from tfgpt.parallel.horovod_bridge import HorovodDistribution
from tfgpt.training import objectives
from tfgpt.training.flags import parse_flags
from tfgpt.training.trainer import train


def main(out, argv):
    train_config, model_overrides, options = parse_flags(argv, options_class=HorovodOptions)
    distribution = HorovodDistribution.create(options, train_config)
    model, metrics = train(train_config, model_overrides, distribution)
    family = family_of_preset(train_config.preset)
    task = objectives.make_task(family.resolve_task(train_config.task), family.name)
    first_inputs, _ = next(iter(task.dataset(
        train_config.data, "train", train_config.batch_size, seed=train_config.seed,
        num_shards=distribution.size, shard_index=distribution.rank)))
    if isinstance(first_inputs, dict):
        first_inputs = first_inputs["token_ids"]
    np.savez(
        f"{out}/rank-{distribution.rank}.npz",
        first_inputs=first_inputs.numpy(),
        val_loss=metrics["val_loss"],
        **{f"weight_{i}": v.numpy() for i, v in enumerate(model.weights)},
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
