r"""Fine-tune a BERT or ALBERT encoder with Horovod data parallelism.

    horovodrun -np 2 python finetune_hvd.py --task classification --init runs/bert \
        --train-file SST-2/train.tsv --validation-file SST-2/dev.tsv --out runs/sst2

Every worker runs this script on its own part of the training file;
gradients are averaged after each step, and each worker evaluates its share
of the validation file at the end. The flags are FinetuneConfig's and the
encoder configs' fields, the same as finetune_mirrored.py's, and
HorovodOptions'.
"""

from tfgpt.config.distribution import HorovodOptions as Options  # Horovod: its flags
from tfgpt.training.front_end import FINETUNE as COMMAND
from tfgpt.training.front_end import exit_after_run


def main(argv=None):
    # Config: parsed and validated before TensorFlow starts.
    config, model_overrides, options = COMMAND.parse_flags(argv, __doc__, Options)

    # Devices.
    # Horovod: imported late so that --help works without a Horovod build.
    from tfgpt.parallel.horovod_bridge import HorovodDistribution as Distribution

    # Horovod: one process per device, a GPU or a share of the CPU cores each.
    # Horovod: rank 0 logs and writes checkpoints; the others stay silent.
    # Data, model, optimizer, loop, save (and a fine-tuning's evaluation): the shared core,
    # which creates the distribution (a refused layout is then one error line).
    return COMMAND.run(config, model_overrides, lambda: Distribution.create(options, config))


if __name__ == "__main__":
    exit_after_run(main())
