"""Train a GPT, BERT or ALBERT with Horovod data parallelism.

    horovodrun -np 2 python train_hvd.py --data data/demo --preset gpt-demo --steps 300

Every worker runs this script on its own part of the data; gradients are
averaged after each step. The flags are TrainConfig's and the model
configs' fields, the same as train_mirrored.py's, and HorovodOptions'.
"""

from tfgpt.config.distribution import HorovodOptions as Options  # Horovod: its flags
from tfgpt.training.front_end import TRAIN as COMMAND
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
