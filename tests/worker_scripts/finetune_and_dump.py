"""Run a fine-tuning front end, then dump the weights every rank or replica holds.

Usage: finetune_and_dump.py {hvd,mirrored} OUT_DIR FRONT_END_FLAGS...
(under horovodrun for hvd). Writes OUT_DIR/rank-R.npz with `weight_I`
(the model's weights) and, under a tf.distribute strategy, `replica_K_weight_I`
(replica K's copy of each mirrored weight).
"""

import sys

import numpy as np

from tfgpt.finetuning import finetuner


def main(front_end, out, argv):
    if front_end == "hvd":
        import finetune_hvd as script
    else:
        import finetune_mirrored as script
    kept = {}
    original = finetuner.finetune

    def finetune_and_keep(config, model_overrides, distribution, callbacks=()):
        model, metrics = original(config, model_overrides, distribution, callbacks)
        kept.update(model=model, rank=distribution.rank)
        return model, metrics

    # The front end looks the core up when it runs (tfgpt.training.front_end).
    finetuner.finetune = finetune_and_keep
    code = script.main(argv)
    if code:
        sys.exit(code)
    arrays = {}
    for index, weight in enumerate(kept["model"].weights):
        arrays[f"weight_{index}"] = weight.numpy()
        for replica, copy in enumerate(getattr(weight.value, "values", ())):
            arrays[f"replica_{replica}_weight_{index}"] = copy.numpy()
    np.savez(f"{out}/rank-{kept['rank']}.npz", **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
