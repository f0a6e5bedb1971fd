"""Train a GPT, BERT or ALBERT with Horovod data parallelism.

    horovodrun -np 2 python train_hvd.py --data data/demo --preset gpt-demo --steps 300

Every worker runs this script on its own part of the data; gradients are
averaged after each step. The flags are TrainConfig's and the model
configs' fields (see `--help`), the same as train_mirrored.py's.
"""

import sys

from tfgpt.training.flags import parse_flags
from tfgpt.training.trainer import TrainingDiverged, train


def main(argv=None):
    # Config: parsed and validated before TensorFlow starts.
    train_config, model_overrides = parse_flags(argv, description=__doc__)

    # Devices.
    # Horovod: imported late so that --help works without a Horovod build.
    from tfgpt.distributed.horovod_bridge import HorovodDistribution

    # Horovod: one process per device; rank 0 logs and writes checkpoints.
    distribution = HorovodDistribution(
        compression="fp16" if train_config.fp16_allreduce else "none",
        bucket_mb=train_config.allreduce_bucket_mb,
    )
    # Horovod: one GPU per local rank, or the CPU cores split between ranks.
    distribution.configure_devices(
        train_config.intra_op_threads, towers=train_config.towers,
        batch_size=train_config.batch_size, xla=train_config.xla,
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
