"""Pipeline schedules measured: the bubble, activation memory per stage, tokens/s.

Each configuration is one `horovodrun -np 2 --gloo -H localhost:2 python -m
bench.pipeline_schedules worker ...` job whose ranks write their figures
to JSON files that this process collects and prints as tables:

- bubble (`--bubble`): a GPT cut into 2 stages (4 chunks for interleaved,
  v = 2) trains `--steps` steps per schedule and micro-batch count M; on
  each rank the executor times each busy tick's computation and the whole
  tick loop. The measured bubble is (loop time - busy time) / busy time,
  per stage, the last step's, and over both stages (the sum of idle time
  over the sum of busy time); beside it the schedule's tick count (idle /
  busy ticks) and the theory, (P - 1) / M, divided by v for interleaved.
  The stages differ when their passes take different times: the stage
  that waits for a slower one idles more. Measured time includes the exchanges (one Horovod cycle,
  1 ms, each) and the backward ticks' being about twice the forward's.
- memory (`--memory`): GPipe and 1F1B at the same M; each rank's peak
  of TensorFlow's CPU allocator during a step above what it held at the
  step's start (`tf.config.experimental.get_memory_info("CPU:0")`, peak
  reset before the step), the second step's: the activations kept for the
  backward passes, the gradients and the step's temporaries. (The
  process's resident set does not show it: the allocator keeps the first
  step's memory.) Beside it the schedule's in-flight micro-batches.
- tokens/s (`--throughput`): the same global batch by 2 data-parallel
  workers (DP2, tfgpt's TrainStep with its Horovod allreduce), by two-way
  tensor parallelism (TP2: both ranks on the whole batch, each with half
  of every block's heads and feed-forward width and of the vocabulary)
  and by one pipeline of 2 stages (PP2, 1F1B, M = `--microbatches`), for
  each preset, the three alternating for `--rounds` rounds; tokens/s of
  the fastest step after the first (the slower rank's), with the
  parameters each rank trains (computes gradients and optimizer state
  for). Two processes share the 2 cores in every layout: these figures
  are about the layouts' costs (exchanges, bubble, memory), not the
  speed-up any of them gives across devices.

Usage:
    python -m bench.pipeline_schedules --bubble --memory --throughput \\
        --presets gpt-mini gpt2-small
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench import print_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# The bubble and memory model: 8 blocks of width 256, long enough
# sequences that a micro-batch's compute outweighs a 1 ms exchange.
BENCH_MODEL = dict(vocabulary_size=2000, num_layers=8, num_heads=4, hidden_dim=256,
                   intermediate_dim=1024, max_sequence_length=256, dropout=0.0)


def _worker(args):
    import keras
    import numpy as np
    import tensorflow as tf

    from tfgpt import GPT
    from tfgpt.config.distribution import HorovodOptions
    from tfgpt.config.models import GPT_PRESETS
    from tfgpt.config.training import TrainConfig
    from tfgpt.optim.optimizers import make_optimizer
    from tfgpt.parallel.horovod_bridge import HorovodDistribution
    from tfgpt.training.front_end import exit_after_run

    pipelined = args.mode == "pp"
    options = HorovodOptions(
        tensor_parallel=2 if args.mode == "tp" else 1,
        pipeline_parallel=2 if pipelined else 1,
        microbatches=args.microbatches if pipelined else 1,
        pipeline_schedule=args.schedule,
        virtual_stages=2 if args.schedule == "interleaved" else 1,
    )
    distribution = HorovodDistribution.create(options)
    keras.utils.set_random_seed(0)
    with distribution.scope():  # TP: this rank's slice of every block
        if args.preset:
            # gpt2-small's 50,257 ids padded to 50,258 in every layout: TP2
            # cuts the vocabulary in halves.
            vocabulary = GPT_PRESETS[args.preset]["vocabulary_size"]
            model = GPT.from_preset(args.preset, dropout=0.0,
                                    vocabulary_size=vocabulary + vocabulary % 2)
        else:
            model = GPT(**BENCH_MODEL)
    config = TrainConfig(data="-", steps=args.steps, warmup_steps=1)
    optimizer = make_optimizer(config, 1, steps=args.steps)
    length = args.sequence_length
    # DP: half the global batch per rank; TP and PP: the whole batch on each.
    whole = args.mode != "dp"
    rows = args.batch_size if whole else args.batch_size // 2
    tokens = np.random.default_rng(0 if whole else distribution.rank).integers(
        0, model.vocabulary_size, (rows, length + 1), dtype=np.int32)
    batch = (tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:]))
    if pipelined:
        from tfgpt.parallel.pipeline_executor import PipelineTrainStep
        from tfgpt.parallel.pipeline_schedule import PipelineSchedule
        from tfgpt.parallel.pipeline_stage import PipelineStage

        schedule = PipelineSchedule(args.schedule, 2, args.microbatches, options.virtual_stages)
        stage = PipelineStage(model, schedule, distribution.rank, sequence_length=length)
        trained = stage.trainable_variables
        optimizer.build(trained)
        step = PipelineTrainStep(stage, optimizer, distribution.pipeline_process_set, timed=True)
    else:
        from tfgpt.training.train_step import TrainStep

        trained = model.trainable_variables
        optimizer.build(trained)
        step = TrainStep(model, optimizer, distribution)
    figures = {"rank": distribution.rank, "seconds": [], "peak_above_entry_mib": [],
               "trained": int(sum(np.prod(v.shape) for v in trained))}
    for _ in range(args.steps):
        distribution.allreduce_mean(tf.constant(0.0)).numpy()  # start together
        tf.config.experimental.reset_memory_stats("CPU:0")
        entry = tf.config.experimental.get_memory_info("CPU:0")["current"]
        start = time.perf_counter()
        result = step(batch)
        float(result["loss"])
        figures["seconds"].append(time.perf_counter() - start)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        figures["peak_above_entry_mib"].append((peak - entry) / 2**20)
        if pipelined:
            busy = sum(end - begin for begin, end in result["tick_times"])
            begin, end = result["loop_time"]
            figures["busy"], figures["loop"] = busy, end - begin
    if pipelined:
        figures["tick_bubble"] = schedule.bubble(distribution.rank)
        figures["theory"] = schedule.theoretical_bubble()
        figures["in_flight"] = schedule.in_flight(distribution.rank)
    with open(os.path.join(args.report, f"rank-{distribution.rank}.json"), "w") as file:
        json.dump(figures, file)
    exit_after_run(0)


def _job(*flags):
    """Runs one 2-rank worker job; returns its ranks' figures."""
    with tempfile.TemporaryDirectory() as report:
        command = [HOROVODRUN, "-np", "2", "--gloo", "-H", "localhost:2", sys.executable, "-m",
                   "bench.pipeline_schedules", "worker", "--report", report, *map(str, flags)]
        environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
        completed = subprocess.run(command, cwd=REPO, env=environment, capture_output=True,
                                   text=True, timeout=1800)
        if completed.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stdout[-3000:]}")
        return [json.load(open(os.path.join(report, f"rank-{rank}.json"))) for rank in (0, 1)]


def bubble_table(args):
    rows = []
    for schedule in ("gpipe", "1f1b", "interleaved"):
        for count in (1, 2, 4, 8):
            if schedule == "interleaved" and count % 2:
                rows.append([schedule, count, "refused: M must be divisible by P", "", "", "", ""])
                continue
            ranks = _job("--mode", "pp", "--schedule", schedule, "--microbatches", count,
                         "--batch-size", args.batch_size, "--sequence-length", 256,
                         "--steps", args.steps)
            measured = [(r["loop"] - r["busy"]) / r["busy"] for r in ranks]
            busy = sum(r["busy"] for r in ranks)
            pooled = (sum(r["loop"] for r in ranks) - busy) / busy
            rows.append([schedule, count, f"{ranks[0]['theory']:.3f}",
                         f"{ranks[0]['tick_bubble']:.3f}", f"{pooled:.3f}",
                         " / ".join(f"{value:.3f}" for value in measured),
                         f"{ranks[0]['loop']:.2f}"])
            print(rows[-1], flush=True)
    print_table(["schedule", "M", "theory", "ticks", "measured", "stage 0 / 1", "ticks s"],
                rows)


def memory_table(args):
    rows = []
    for schedule in ("gpipe", "1f1b"):
        ranks = _job("--mode", "pp", "--schedule", schedule, "--microbatches", 8,
                     "--batch-size", args.batch_size, "--sequence-length", 256, "--steps", 2)
        rows.append([schedule, 8] + [
            f"{r['peak_above_entry_mib'][-1]:.0f} MiB ({r['in_flight']:.0f} in flight)"
            for r in ranks])
        print(rows[-1], flush=True)
    print_table(["schedule", "M", "stage 0 step peak", "stage 1 step peak"], rows)


LAYOUTS = {"dp": "DP2", "tp": "TP2", "pp": "PP2 (1f1b, M={microbatches})"}


def throughput_table(args):
    seconds = {}  # (preset, mode) -> the fastest step of each round
    trained = {}
    for round_ in range(args.rounds):
        for preset in args.presets:
            for mode in LAYOUTS:
                ranks = _job("--mode", mode, "--preset", preset, "--schedule", "1f1b",
                             "--microbatches", args.microbatches, "--batch-size",
                             args.batch_size, "--sequence-length", 128, "--steps", args.steps)
                # The first step traces; the slower rank sets the pace.
                step = max(min(r["seconds"][1:]) for r in ranks)
                seconds.setdefault((preset, mode), []).append(step)
                trained[preset, mode] = max(r["trained"] for r in ranks)
                print(f"round {round_ + 1}: {preset} {mode} {step:.2f} s", flush=True)
    rows = []
    for (preset, mode), steps in seconds.items():
        tokens = [args.batch_size * 128 / step for step in steps]
        data = seconds[preset, "dp"]
        rows.append([preset, LAYOUTS[mode].format(microbatches=args.microbatches),
                     " / ".join(f"{value:,.0f}" for value in tokens),
                     " / ".join(f"{d / s:.2f}" for d, s in zip(data, steps)),
                     f"{trained[preset, mode]:,}"])
    print_table(["preset", "layout", "tokens/s per round", "vs DP2 per round",
                 "parameters trained per rank"], rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="driver", choices=("driver", "worker"))
    parser.add_argument("--bubble", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--presets", nargs="+", default=["gpt-mini", "gpt2-small"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    # The worker's own flags.
    parser.add_argument("--report")
    parser.add_argument("--mode", choices=("pp", "dp", "tp"), default="pp")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--preset")
    parser.add_argument("--sequence-length", type=int, default=256)
    args = parser.parse_args(argv)
    if args.role == "worker":
        return _worker(args)
    if args.bubble:
        bubble_table(args)
    if args.memory:
        memory_table(args)
    if args.throughput:
        throughput_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
