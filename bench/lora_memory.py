"""Low-rank adapters against full fine-tuning: the state a worker holds, and its tokens/s.

Each (preset, method) runs in a fresh process (`python -m bench.lora_memory
worker ...`) that builds the preset's model (dropout 0), for `lora` adds
adapters (`tfgpt.models.adapters.add_adapters`: rank 8 on the default
projections, the rest frozen), builds AdamW on what trains and runs
`--steps` training steps (`TrainStep`, one process) on random tokens. The
figures:

- trained: the parameters that train (the whole model, or the adapters);
- training state: what training adds to the weights, per worker, in
  float32: each trained parameter's gradient and two AdamW moments (12
  bytes); the weights themselves (4 bytes a parameter, trained or frozen)
  are the same for both and shown apart. With ZeRO, full fine-tuning's
  state is cut over the data group; the adapters' is small either way;
- peak RSS: the process's high-water mark (VmHWM), with TensorFlow;
- tokens/s: over the timed steps, after `--warmup` untimed ones; the
  median of `--repeats` processes per method, run alternately (full, LoRA,
  LoRA, full, ...) so that a change of the machine's load falls on both;
- tokens per CPU second: the same steps over the process's CPU time (all
  its threads), steadier than the wall's rate on a loaded machine.

A configuration whose estimated peak (weights, state and the measured
start-up) would pass `--memory-limit-gb` is computed, not run. A bench, not
a test: it prints, it asserts nothing.

    python -m bench.lora_memory --presets gpt2-medium llama3.2-1b --sequence-length 128
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("full", "lora")
STATE_BYTES = 12  # a gradient and two AdamW moments, float32
WEIGHT_BYTES = 4


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def worker(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.lora_memory worker")
    parser.add_argument("--preset", required=True)
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    from tfgpt import GPT
    from tfgpt.config import TrainConfig
    from tfgpt.models.adapters import add_adapters
    from tfgpt.optim.optimizers import make_optimizer
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.train_step import TrainStep

    keras.utils.set_random_seed(0)
    start_up = _status_kib("VmRSS")
    model = GPT.from_preset(args.preset, dropout=0.0)
    if args.method == "lora":
        add_adapters(model, rank=8)
    trained = model.trainable_variables
    optimizer = make_optimizer(TrainConfig(data="-", warmup_steps=0))
    optimizer.build(trained)
    step = TrainStep(model, optimizer, LocalDistribution())
    tokens = np.random.default_rng(0).integers(
        0, model.vocabulary_size, (args.batch_size, args.sequence_length + 1), dtype=np.int32)
    inputs, targets = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])
    for _ in range(args.warmup):
        step(inputs, targets)
    begin, begin_cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        loss = float(step(inputs, targets)["loss"])
    seconds, cpu_seconds = time.perf_counter() - begin, time.process_time() - begin_cpu
    tokens = args.steps * args.batch_size * args.sequence_length
    print(json.dumps({
        "parameters": int(sum(np.prod(v.shape) for v in model.weights)),
        "trained": int(sum(np.prod(v.shape) for v in trained)),
        "start_up_kib": start_up,
        "high_water_kib": _status_kib("VmHWM"),
        "tokens_per_second": tokens / seconds,
        "tokens_per_cpu_second": tokens / cpu_seconds,
        "loss": loss,
    }))


def parameter_counts(preset):
    """`(parameters, adapter parameters)` of a preset, built without weights."""
    import numpy as np

    from tfgpt import GPT
    from tfgpt.models.adapters import add_adapters
    from tfgpt.parallel.unallocated import build_unallocated

    model = build_unallocated(lambda: GPT.from_preset(preset, dropout=0.0))
    total = int(sum(np.prod(v.shape) for v in model.weights))
    add_adapters(model, rank=8)
    adapters = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    return total, adapters


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    from tfgpt.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="python -m bench.lora_memory", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["gpt2-medium", "llama3.2-1b"],
                        help="GPT presets to measure")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--sequence-length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--repeats", type=int, default=2,
                        help="processes per method, run alternately; their median is shown")
    parser.add_argument("--memory-limit-gb", type=float, default=16.0,
                        help="a configuration whose estimated peak passes this is computed only")
    args = parser.parse_args(argv)
    from tfgpt.observe.flops import processor_name

    print(f"machine: {processor_name()}, {os.cpu_count()} CPUs; batch {args.batch_size} x "
          f"{args.sequence_length} tokens, float32, AdamW, one process", flush=True)
    for preset in args.presets:
        total, adapters = parameter_counts(preset)
        rows, runs = {}, {method: [] for method in METHODS}
        for method in METHODS:
            trained = total if method == "full" else adapters
            state = trained * STATE_BYTES
            estimate = total * WEIGHT_BYTES + state + 2**30  # and about 1 GiB to start
            rows[method] = {"trained": trained, "state_gb": state / 1e9,
                            "weights_gb": total * WEIGHT_BYTES / 1e9}
            if estimate > args.memory_limit_gb * 2**30:
                rows[method]["note"] = f"not run: about {estimate / 2**30:.0f} GiB"
        # full, LoRA, LoRA, full, ...: a load that changes meets both methods alike
        order = [METHODS[turn] for repeat in range(args.repeats)
                 for turn in ((0, 1) if repeat % 2 == 0 else (1, 0))]
        for method in order:
            if "note" in rows[method]:
                continue
            command = [sys.executable, "-m", "bench.lora_memory", "worker", "--preset",
                       preset, "--method", method, "--batch-size", str(args.batch_size),
                       "--sequence-length", str(args.sequence_length),
                       "--steps", str(args.steps)]
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                             PYTHONPATH=REPO))
            if result.returncode:
                raise RuntimeError(f"{preset} {method} failed:\n{result.stderr[-3000:]}")
            runs[method].append(json.loads(result.stdout.strip().splitlines()[-1]))
        for method, figures in runs.items():
            if figures:
                rows[method].update(
                    peak_gb=max(run["high_water_kib"] for run in figures) / 2**20,
                    **{key: statistics.median(run[key] for run in figures)
                       for key in ("tokens_per_second", "tokens_per_cpu_second")})
        full, lora = rows["full"], rows["lora"]
        for method, row in rows.items():
            measured = (f"peak RSS {row['peak_gb']:.2f} GiB, {row['tokens_per_second']:,.1f} "
                        f"tokens/s, {row['tokens_per_cpu_second']:,.1f} tokens per CPU second"
                        if "peak_gb" in row else row["note"])
            print(f"{preset} {method}: trains {row['trained']:,} of {total:,} parameters; "
                  f"training state {row['state_gb']:.3f} GB beside {row['weights_gb']:.2f} GB "
                  f"of weights; {measured}", flush=True)
        ratio = lora["state_gb"] / full["state_gb"]
        speed = (f"; tokens/s x{lora['tokens_per_second'] / full['tokens_per_second']:.2f}, "
                 "per CPU second x"
                 f"{lora['tokens_per_cpu_second'] / full['tokens_per_cpu_second']:.2f}"
                 if "peak_gb" in full and "peak_gb" in lora else "")
        print(f"{preset}: LoRA's training state is {ratio:.4f} of full fine-tuning's{speed}",
              flush=True)


if __name__ == "__main__":
    main()
