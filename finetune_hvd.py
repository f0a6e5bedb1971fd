"""Fine-tune a BERT or ALBERT encoder with Horovod data parallelism.

    horovodrun -np 2 python finetune_hvd.py --task classification --init runs/bert \
        --train-file SST-2/train.tsv --validation-file SST-2/dev.tsv --out runs/sst2

Every worker runs this script on its own part of the training file;
gradients are averaged after each step, and each worker evaluates its share
of the validation file at the end. The flags are FinetuneConfig's and the
encoder configs' fields (see `--help`), the same as finetune_mirrored.py's.
"""

import sys

from tfgpt.finetuning import finetune, parse_flags
from tfgpt.training.trainer import TrainingDiverged


def main(argv=None):
    # Config: parsed and validated before TensorFlow starts.
    config, model_overrides = parse_flags(argv, description=__doc__)

    # Devices.
    # Horovod: imported late so that --help works without a Horovod build.
    from tfgpt.distributed.horovod_bridge import HorovodDistribution

    # Horovod: one process per device; rank 0 logs and writes checkpoints.
    distribution = HorovodDistribution(
        compression="fp16" if config.fp16_allreduce else "none",
        bucket_mb=config.allreduce_bucket_mb,
    )
    # Horovod: one GPU per local rank, or the CPU cores split between ranks.
    distribution.configure_devices(
        config.intra_op_threads, towers=config.towers, batch_size=config.batch_size,
        xla=config.xla,
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
