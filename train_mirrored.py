"""Train a GPT, BERT or ALBERT with a tf.distribute strategy.

    python train_mirrored.py --strategy mirrored --data data/demo --preset gpt-demo --steps 300

`--strategy multi-worker` runs one process per worker with the cluster in
`TF_CONFIG`. The flags are TrainConfig's and the model configs' fields,
the same as train_hvd.py's, and StrategyOptions'.
"""

from tfgpt.config.distribution import StrategyOptions as Options  # Distribute: its flags
from tfgpt.training.front_end import TRAIN as COMMAND
from tfgpt.training.front_end import exit_after_run


def main(argv=None):
    # Config: parsed and validated before TensorFlow starts.
    config, model_overrides, options = COMMAND.parse_flags(argv, __doc__, Options)

    # Devices.
    # Distribute: imported late so that --help does not start TensorFlow.
    from tfgpt.parallel.strategy import StrategyDistribution as Distribution

    # Distribute: replicas from the strategy, variables mirrored on them.
    # Distribute: workers on one machine split its CPU cores, as Horovod's ranks do.
    # Data, model, optimizer, loop, save (and a fine-tuning's evaluation): the shared core,
    # which creates the distribution (a refused layout is then one error line).
    return COMMAND.run(config, model_overrides, lambda: Distribution.create(options, config))


if __name__ == "__main__":
    exit_after_run(main())
