"""Peak memory of a training step, with and without activation recomputation.

Each configuration runs in a fresh process (`python -m bench.memory worker
...`) that builds the model and its AdamW state, runs `--steps` training
steps on random tokens and exits. The figures:

- peak RSS: the child's `ru_maxrss` (from `os.wait4`: the rusage of that
  child alone), which includes the Python interpreter, TensorFlow's
  libraries and the model's weights, gradients and optimizer slots;
- step peak: the child's own high-water mark (VmHWM) minus its resident
  set just before the first step, which is what the step itself (its
  activations, and for XLA its compiled buffers) added.

Usage:
    python -m bench.memory --presets gpt-mini gpt2-small --batch-size 1
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def worker_main(argv):
    from tfgpt.cli import HelpFormatter
    from tfgpt.config import GPT_PRESETS

    parser = argparse.ArgumentParser(
        prog="python bench/memory.py worker", formatter_class=HelpFormatter,
        description="One measured process: a few training steps of one preset.",
    )
    parser.add_argument("--preset", required=True, choices=list(GPT_PRESETS), help="GPT preset")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--sequence-length", type=int, default=0, help="0: the preset's context")
    parser.add_argument("--steps", type=int, default=2, help="training steps to run")
    parser.add_argument("--recompute", action="store_true", help="recompute the GPT blocks")
    parser.add_argument("--xla", action="store_true", help="compile the step with XLA")
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    from tfgpt import GPT
    from tfgpt.config import TrainConfig
    from tfgpt.distributed import LocalDistribution
    from tfgpt.layers.transformer_block import set_recompute
    from tfgpt.training.optimizers import make_optimizer
    from tfgpt.training.train_step import TrainStep

    keras.utils.set_random_seed(0)
    model = GPT.from_preset(args.preset, dropout=0.0)
    set_recompute(model, args.recompute)
    optimizer = make_optimizer(TrainConfig(data="-", warmup_steps=0))
    optimizer.build(model.trainable_variables)
    step = TrainStep(model, optimizer, LocalDistribution(), xla=args.xla)
    length = args.sequence_length or model.max_sequence_length
    tokens = np.random.default_rng(0).integers(
        0, model.vocabulary_size, (args.batch_size, length + 1), dtype=np.int32
    )
    inputs, targets = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])
    before = _status_kib("VmRSS")
    for _ in range(args.steps):
        loss = float(step(inputs, targets)["loss"])
    print(json.dumps({
        "rss_before_step_kib": before,
        "high_water_kib": _status_kib("VmHWM"),
        "loss": loss,
        "parameters": model.count_params(),
        "sequence_length": length,
    }))


def measure(preset, batch_size, recompute, xla=False, steps=2, sequence_length=0):
    """Runs one configuration in a child process; returns its figures in MiB."""
    argv = [sys.executable, "-m", "bench.memory", "worker", "--preset", preset,
            "--batch-size", str(batch_size), "--steps", str(steps),
            "--sequence-length", str(sequence_length)]
    if recompute:
        argv.append("--recompute")
    if xla:
        argv.append("--xla")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)
        # wait4 reaps this child alone and returns its own rusage (getrusage's
        # RUSAGE_CHILDREN would give the maximum over every child so far).
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        output, errors = stdout.read(), stderr.read()
    if process.returncode != 0:
        raise RuntimeError(f"memory worker {preset} failed:\n{errors[-3000:]}")
    figures = json.loads(output.strip().splitlines()[-1])
    return {
        "preset": preset,
        "batch_size": batch_size,
        "sequence_length": figures["sequence_length"],
        "recompute": recompute,
        "xla": xla,
        "parameters": figures["parameters"],
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "step_peak_mib": (figures["high_water_kib"] - figures["rss_before_step_kib"]) / 1024,
        "loss": figures["loss"],
    }


def main(argv=None):
    from tfgpt.cli import HelpFormatter
    from tfgpt.config import GPT_PRESETS

    parser = argparse.ArgumentParser(
        prog="python bench/memory.py", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--presets", nargs="+", default=["gpt-mini", "gpt2-small"], choices=list(GPT_PRESETS),
        metavar="PRESET", help=f"GPT presets to measure, each with and without recomputation "
        f"(choices: {', '.join(GPT_PRESETS)})",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--xla", action="store_true", help="compile the steps with XLA")
    parser.add_argument(
        "--out", default=os.path.join(REPO, "bench", "results"), metavar="DIR",
        help="directory for memory.json",
    )
    args = parser.parse_args(argv)
    rows = []
    for preset in args.presets:
        for recompute in (False, True):
            row = measure(preset, args.batch_size, recompute, xla=args.xla)
            print(f"{preset:12s} recompute={str(recompute):5s} peak RSS {row['peak_rss_mib']:8.0f} MiB"
                  f"  step {row['step_peak_mib']:8.0f} MiB", flush=True)
            rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory.json"), "w") as file:
        json.dump(rows, file, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        main()
