"""One tf.distribute worker: train with train_mirrored's core, dump the weights.

Usage: mirrored_train_and_dump.py OUT_DIR TRAIN_MIRRORED_FLAGS...
(with TF_CONFIG set for multi-worker). Writes OUT_DIR/worker-R.npz.
"""

import sys

import numpy as np

import train_mirrored
from tfgpt.training import trainer


def main(out, argv):
    dumped = {}
    original = trainer.train

    def train_and_keep(config, model_overrides, distribution, callbacks=()):
        model, metrics = original(config, model_overrides, distribution, callbacks)
        dumped["model"], dumped["rank"] = model, distribution.rank
        return model, metrics

    # The front end looks the core up when it runs (tfgpt.training.front_end).
    trainer.train = train_and_keep
    code = train_mirrored.main(argv)
    if code:
        sys.exit(code)
    np.savez(
        f"{out}/worker-{dumped['rank']}.npz",
        **{f"weight_{i}": v.numpy() for i, v in enumerate(dumped["model"].weights)},
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
