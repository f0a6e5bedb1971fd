"""Train a GPT, BERT or ALBERT with a tf.distribute strategy.

    python train_mirrored.py --strategy mirrored --data data/demo --preset gpt-demo --steps 300

`--strategy multi-worker` runs one process per worker with the cluster in
`TF_CONFIG`. The flags are TrainConfig's and the model configs' fields
(see `--help`), the same as train_hvd.py's, plus `--strategy`.
"""

import sys

from tfgpt.config import ALLREDUCE_BUCKET_MB
from tfgpt.training.flags import parse_flags
from tfgpt.training.trainer import TrainingDiverged, train


def add_strategy_flags(parser):
    # Distribute: the strategy, and CPU replicas for machines without GPUs.
    from tfgpt.distributed.strategy import STRATEGIES

    group = parser.add_argument_group("tf.distribute")
    group.add_argument("--strategy", choices=STRATEGIES, default="mirrored")
    group.add_argument("--logical-cpus", type=int, default=0,
                       help="split the CPU into this many logical devices (replicas)")
    return ("strategy", "logical_cpus")


def main(argv=None):
    # Config: parsed and validated before TensorFlow starts.
    train_config, model_overrides, flags = parse_flags(
        argv, description=__doc__, add_arguments=add_strategy_flags
    )
    if train_config.fp16_allreduce:
        print("error: --fp16-allreduce is a Horovod option (train_hvd.py)", file=sys.stderr)
        return 2
    if train_config.allreduce_bucket_mb != ALLREDUCE_BUCKET_MB:
        print("error: --allreduce-bucket-mb is a Horovod option (train_hvd.py)", file=sys.stderr)
        return 2

    # Devices.
    from tfgpt.distributed.strategy import StrategyDistribution

    # Distribute: replicas from the strategy; variables are mirrored on them.
    # Distribute: the CPU cores split between workers on one machine.
    distribution = StrategyDistribution.create(
        flags["strategy"], flags["logical_cpus"], train_config.intra_op_threads,
        towers=train_config.towers, batch_size=train_config.batch_size, xla=train_config.xla,
    )

    # Data, model, optimizer, loop, save: the shared core.
    try:
        train(train_config, model_overrides, distribution)
    except (ValueError, TrainingDiverged) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
