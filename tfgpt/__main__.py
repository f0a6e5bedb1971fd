"""tfgpt: one command for each job, `tfgpt SUBCOMMAND [FLAGS]` (or `python -m tfgpt`).

    tfgpt prepare --input corpus.txt --output data/mine --seq-len 256
    horovodrun -np 2 tfgpt train --data data/mine --preset gpt-mini --out runs/mine
    tfgpt generate --checkpoint runs/mine --prompt "The" --max-new-tokens 40
    tfgpt checkpoint runs/mine --verify

Each subcommand is one of the front ends below, with the same flags:
`tfgpt SUBCOMMAND --help` lists them. `train` and `finetune` are
train_hvd.py and finetune_hvd.py (one process, or one per horovodrun
rank); given `--strategy`, train_mirrored.py and finetune_mirrored.py (a
tf.distribute strategy). Nothing here imports TensorFlow: a subcommand's
`--help` and its flag errors come before it.
"""

import importlib.util
import os
import runpy
import sys

# name: (the module run as `python -m MODULE`, what it does).
SUBCOMMANDS = {
    "prepare": ("pipelines.prepare", "raw text to a tokenizer and sharded TFRecords"),
    "train": ("train_hvd", "pretrain a GPT, BERT or ALBERT (Horovod; --strategy: tf.distribute)"),
    "finetune": ("finetune_hvd", "fine-tune an encoder on classification or SQuAD (the same)"),
    "generate": ("tfgpt.generate", "sample text from a checkpoint"),
    "export": ("tfgpt.export", "a checkpoint as a SavedModel"),
    "convert": ("tfgpt.convert", "Hugging Face checkpoints to tfgpt runs and back"),
    "checkpoint": ("tfgpt.show_checkpoint", "what a checkpoint holds; --verify reads it back"),
    "report": ("tfgpt.report", "a run's summary: loss, speed, time split, rules"),
    "bench": ("bench.run", "the benchmarks: a table, JSON and a plot"),
}
# With --strategy, the tf.distribute front end of the same job.
STRATEGY_FRONT_ENDS = {"train": "train_mirrored", "finetune": "finetune_mirrored"}


def usage():
    width = max(map(len, SUBCOMMANDS))
    listed = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items())
    return (f"usage: tfgpt SUBCOMMAND [FLAGS]   (tfgpt SUBCOMMAND --help for its flags)\n\n"
            f"{__doc__.split(chr(10), 1)[1].strip(chr(10))}\n\nsubcommands:\n{listed}\n")


def module_of(name, arguments):
    """The module that runs the subcommand `name` with `arguments`."""
    module = SUBCOMMANDS[name][0]
    if name in STRATEGY_FRONT_ENDS and any(
            argument == "--strategy" or argument.startswith("--strategy=")
            for argument in arguments):
        module = STRATEGY_FRONT_ENDS[name]
    return module


def importable(module):
    """Whether `module` imports; the front ends at the top of the source tree
    (train_hvd.py, bench/) are not in the package: they import from the tree
    that holds this package (a clone, installed with `pip install -e .`)."""
    tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if importlib.util.find_spec(module.split(".")[0]) is None and tree not in sys.path:
        sys.path.insert(0, tree)
    return importlib.util.find_spec(module.split(".")[0]) is not None


def main(argv=None):
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not arguments or arguments[0] in ("-h", "--help"):
        (sys.stdout if arguments else sys.stderr).write(usage())
        return 0 if arguments else 2
    name, rest = arguments[0], arguments[1:]
    if name not in SUBCOMMANDS:
        sys.stderr.write(f"tfgpt: error: no subcommand {name!r}; choose from "
                         f"{', '.join(SUBCOMMANDS)} (tfgpt --help)\n")
        return 2
    module = module_of(name, rest)
    if not importable(module):
        sys.stderr.write(f"tfgpt: error: tfgpt {name} runs {module}, which is not here: it lives "
                         "in tfgpt's source tree (a clone installed with `pip install -e .`)\n")
        return 2
    # As `python -m MODULE REST...`: the front end's own `__main__` block
    # (its exit path, its signal handlers) runs as it would.
    sys.argv = [f"tfgpt {name}", *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
