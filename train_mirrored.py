"""Train a GPT with a tf.distribute strategy.

    python train_mirrored.py --strategy mirrored --data data/demo --preset gpt-demo --steps 300

`--strategy multi-worker` runs one process per worker, each with the
cluster in `TF_CONFIG`. The flags are TrainConfig's and GPTConfig's
fields (see `--help`), the same as train_hvd.py's.
"""

import json
import os
import sys

from tfgpt.training.flags import parse_flags
from tfgpt.training.trainer import TrainingDiverged, train


def add_strategy_arguments(parser):
    from tfgpt.distributed.strategy import STRATEGIES

    group = parser.add_argument_group("tf.distribute")
    group.add_argument("--strategy", choices=STRATEGIES, default="mirrored")
    group.add_argument(
        "--logical-cpus", type=int, default=0,
        help="split the CPU into this many logical devices (replicas without GPUs)",
    )
    return ("strategy", "logical_cpus")


def main(argv=None):
    # Config: parsed and validated before TensorFlow starts.
    train_config, model_overrides, extras = parse_flags(
        argv, description=__doc__, add_arguments=add_strategy_arguments
    )
    if train_config.fp16_allreduce:
        print("error: --fp16-allreduce is a Horovod option (train_hvd.py)", file=sys.stderr)
        return 2

    # Devices.
    import tensorflow as tf

    from tfgpt.distributed.strategy import StrategyDistribution, make_strategy

    # Distribute: workers sharing a machine split its cores, as Horovod's ranks do.
    workers_here = len(json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {}).get("worker", [0]))
    threads = train_config.intra_op_threads or max(1, (os.cpu_count() or 1) // workers_here)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    if extras["logical_cpus"] > 1:
        # Distribute: one replica per logical CPU device.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * extras["logical_cpus"]
        )
    # Distribute: the strategy decides the replicas; variables are mirrored.
    distribution = StrategyDistribution(make_strategy(extras["strategy"]))

    # Data, model, optimizer, loop, save: the shared core.
    try:
        train(train_config, model_overrides, distribution)
    except (ValueError, TrainingDiverged) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
