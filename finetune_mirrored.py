"""Fine-tune a BERT or ALBERT encoder with a tf.distribute strategy.

    python finetune_mirrored.py --strategy mirrored --task squad --init runs/albert \
        --train-file train-v1.1.json --validation-file dev-v1.1.json --out runs/squad

`--strategy multi-worker` runs one process per worker with the cluster in
`TF_CONFIG`. The flags are FinetuneConfig's and the encoder configs' fields
(see `--help`), the same as finetune_hvd.py's, plus `--strategy`.
"""

import sys

from tfgpt.config import ALLREDUCE_BUCKET_MB
from tfgpt.finetuning import finetune, parse_flags
from tfgpt.training.trainer import TrainingDiverged


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
    config, model_overrides, flags = parse_flags(
        argv, description=__doc__, add_arguments=add_strategy_flags
    )
    if config.fp16_allreduce:
        print("error: --fp16-allreduce is a Horovod option (finetune_hvd.py)", file=sys.stderr)
        return 2
    if config.allreduce_bucket_mb != ALLREDUCE_BUCKET_MB:
        print("error: --allreduce-bucket-mb is a Horovod option (finetune_hvd.py)", file=sys.stderr)
        return 2

    # Devices.
    from tfgpt.distributed.strategy import StrategyDistribution

    # Distribute: replicas from the strategy; variables are mirrored on them.
    # Distribute: the CPU cores split between workers on one machine.
    distribution = StrategyDistribution.create(
        flags["strategy"], flags["logical_cpus"], config.intra_op_threads,
        towers=config.towers, batch_size=config.batch_size, xla=config.xla,
    )

    # Data, model, optimizer, loop, save, evaluation: the fine-tuning core.
    try:
        finetune(config, distribution, model_overrides)
    except (ValueError, TrainingDiverged) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
