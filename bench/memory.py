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

ZeRO (`--zero-stage S [S ...]`): each (preset, workers, stage) is one
`horovodrun -np N --gloo -H localhost:N python -m bench.memory worker
--zero-stage S ...` job. Its ranks build the model, the optimizer and the
`ZeroSharding` as `train_hvd.py --zero-stage S` does
(`tfgpt.training.loop.build_model_and_optimizer`, then `RunPart.broadcast`),
run `TrainStep` on random tokens, and each writes its own figures to a JSON
file that this process collects (`ru_maxrss` of a horovodrun child would
be horovodrun's, not a rank's):

- computed: `tfgpt.parallel.zero.state_bytes` of the rank, "state"
  (parameters, gradients, AdamW moments) and "total" (stage 3 adds the
  largest unit's gathered weights and their gradients);
- peak RSS: the rank's VmHWM at the end, the table shows the largest rank;
- runtime: the rank's resident set before it builds the model (Python,
  TensorFlow, Horovod and Gloo started), and its resident set before the
  first step;
- rest: peak - runtime - computed total, what the computation does not
  account for (activations, the step's temporaries, the allocator's slack);
- per step (printed as each job ends, and in the JSON): the peak above the
  resident set on entry to the step (VmHWM restarted through
  `/proc/self/clear_refs`) and the resident set after it.

Ratios are to stage 0 at the same worker count. `--budget-gb G` then finds,
for each preset, workers and stage measured, the deepest GPT of the
preset's width (`num_layers` varied, every other field the preset's) whose
computed total plus the measured runtime (the largest rank's, of that
configuration's run) fits G GiB: computed for every depth, not run.

Usage:
    python -m bench.memory --presets gpt-mini gpt2-small --batch-size 1
    python -m bench.memory --presets gpt2-small --zero-stage 0 1 2 3 --workers 1 2 \\
        --recompute --sequence-length 128 --budget-gb 8
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench import print_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
GIB = 2**30


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak():
    """Restarts VmHWM from the current resident set (Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        return True
    except OSError:
        return False


# ---- What ZeRO's state comes to, without building a model ---------------------


def gpt_parameters(fields):
    """`(parameters, largest_unit)` of a GPT with these `GPTConfig` fields.

    `parameters` counts the trainable parameters; `largest_unit` those of
    the largest set ZeRO stage 3 gathers at once
    (`ZeroSharding.largest_unit`): one transformer block, or the rest of the
    model (token and position tables, final norm, untied head).

    Example:
    >>> from tfgpt.config import GPT_PRESETS
    >>> gpt_parameters(GPT_PRESETS["gpt2-small"])
    (124439808, 39385344)
    """
    hidden, intermediate = fields["hidden_dim"], fields["intermediate_dim"]
    block = (
        4 * hidden * hidden + 4 * hidden  # query_key_value (C, 3C) and output (C, C), biases
        + 2 * hidden * intermediate + intermediate + hidden  # feed-forward (C, I), (I, C)
        + 4 * hidden  # two layer norms, scale and offset
    )
    rest = (fields["vocabulary_size"] + fields["max_sequence_length"]) * hidden
    if fields["norm_first"]:
        rest += 2 * hidden  # final_norm
    if not fields["tie_embeddings"]:
        rest += fields["vocabulary_size"] * hidden  # lm_head, no bias
    return fields["num_layers"] * block + rest, max(block, rest)


def budget_depth(fields, stage, workers, budget_bytes, overhead_bytes):
    """The deepest GPT of `fields`' width whose computed state fits a budget per rank.

    Args:
        fields: dict of `GPTConfig` fields; all but `num_layers` are kept.
        stage: int. ZeRO stage.
        workers: int. Data-parallel ranks.
        budget_bytes: int. Memory per rank.
        overhead_bytes: int. What a rank holds besides the computed state
            (the runtime, measured).

    Returns:
        dict: `num_layers` (0 when not even one block fits), its
        `parameters` and `total` (`state_bytes(...)["total"]` per rank).

    Example:
    >>> from tfgpt.config import GPT_PRESETS
    >>> budget_depth(GPT_PRESETS["gpt2-small"], 0, 1, 2 * 2**30, 2**29)["num_layers"]
    8
    """
    from tfgpt.config.distribution import ZERO_STAGES
    from tfgpt.parallel.zero import state_bytes

    if stage not in ZERO_STAGES:
        raise ValueError(f"`stage` must be one of {ZERO_STAGES}. Received: stage={stage!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"`workers` must be a positive int. Received: workers={workers!r}")
    if not budget_bytes > 0:
        raise ValueError(f"`budget_bytes` must be positive. Received: budget_bytes={budget_bytes!r}")
    if not overhead_bytes >= 0:
        raise ValueError(
            f"`overhead_bytes` must be non-negative. Received: overhead_bytes={overhead_bytes!r}"
        )

    def at(layers):
        parameters, unit = gpt_parameters({**fields, "num_layers": layers})
        total = state_bytes(parameters, stage, workers, gathered=unit)["total"]
        return {"num_layers": layers, "parameters": parameters, "total": total}

    def fits(layers):
        return overhead_bytes + at(layers)["total"] <= budget_bytes

    if not fits(1):
        return {**at(0), "num_layers": 0}
    # Every block adds bytes: double until a depth does not fit, then bisect.
    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return at(low)


# ---- Workers -------------------------------------------------------------------


def worker_main(argv):
    from tfgpt.cli import HelpFormatter
    from tfgpt.config import GPT_PRESETS
    from tfgpt.config.distribution import ZERO_STAGES

    parser = argparse.ArgumentParser(
        prog="python bench/memory.py worker", formatter_class=HelpFormatter,
        description="One measured process: a few training steps of one preset "
        "(with --zero-stage, one rank of a horovodrun job).",
    )
    parser.add_argument("--preset", required=True, choices=list(GPT_PRESETS), help="GPT preset")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--sequence-length", type=int, default=0, help="0: the preset's context")
    parser.add_argument("--steps", type=int, default=2, help="training steps to run")
    parser.add_argument("--recompute", action="store_true", help="recompute the GPT blocks")
    parser.add_argument("--xla", action="store_true", help="compile the step with XLA")
    parser.add_argument(
        "--zero-stage", type=int, choices=ZERO_STAGES, default=None,
        help="run as a rank of a horovodrun job with this ZeRO stage (0: whole state on "
        "every rank) and write its figures to --report; unset: one process, no Horovod",
    )
    parser.add_argument("--report", metavar="DIR",
                        help="with --zero-stage: directory for this rank's rank-R.json")
    args = parser.parse_args(argv)
    if args.zero_stage is not None:
        if not args.report:
            parser.error("--zero-stage needs --report DIR")
        zero_worker(args)
        return

    import keras
    import numpy as np
    import tensorflow as tf

    from tfgpt import GPT
    from tfgpt.config import TrainConfig
    from tfgpt.layers.transformer_block import set_recompute
    from tfgpt.optim.optimizers import make_optimizer
    from tfgpt.parallel import LocalDistribution
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


def zero_worker(args):
    """One rank of a ZeRO job: built as train_hvd.py builds it; writes REPORT/rank-R.json."""
    import numpy as np
    import tensorflow as tf

    from tfgpt import GPT
    from tfgpt.config import TrainConfig
    from tfgpt.layers.transformer_block import set_recompute
    from tfgpt.parallel.horovod_bridge import HorovodDistribution
    from tfgpt.parallel.zero import state_bytes
    from tfgpt.training import loop
    from tfgpt.training.front_end import exit_after_run

    distribution = HorovodDistribution(zero_stage=args.zero_stage)
    distribution.configure_devices(towers=1)
    runtime = _status_kib("VmRSS")
    config = TrainConfig(data="-", warmup_steps=0, xla=args.xla)
    part = loop.build_model_and_optimizer(
        config, distribution, lambda: GPT.from_preset(args.preset, dropout=0.0), args.steps
    )
    model, zero = part.model, part.sharding
    if args.recompute and not set_recompute(model, True):
        raise ValueError(f"--recompute: --preset {args.preset} has no transformer blocks")
    step = part.train_step(xla=args.xla)
    part.broadcast()
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    unit = zero.largest_unit()
    length = args.sequence_length or model.max_sequence_length
    # Every rank its own tokens, as data parallelism gives it.
    tokens = np.random.default_rng(distribution.rank).integers(
        0, model.vocabulary_size, (args.batch_size, length + 1), dtype=np.int32
    )
    inputs, targets = tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:])
    before = _status_kib("VmRSS")
    high_water = _status_kib("VmHWM")
    seconds, per_step = [], []
    for _ in range(args.steps):
        entry = _status_kib("VmRSS")
        reset = _reset_peak()
        start = time.perf_counter()
        loss = float(step(inputs, targets)["loss"])
        seconds.append(time.perf_counter() - start)
        peak = _status_kib("VmHWM")
        high_water = max(high_water, peak)
        per_step.append({"peak_above_entry_kib": peak - entry if reset else None,
                         "rss_after_kib": _status_kib("VmRSS")})
    figures = {
        "rank": distribution.rank,
        "size": distribution.size,
        "stage": args.zero_stage,
        "runtime_rss_kib": runtime,
        "rss_before_step_kib": before,
        "high_water_kib": max(high_water, _status_kib("VmHWM")),
        "loss": loss,
        "step_seconds": seconds,
        "steps": per_step,
        "parameters": parameters,
        "largest_unit": unit,
        "state_bytes": state_bytes(parameters, args.zero_stage, distribution.size, gathered=unit),
        "sequence_length": length,
    }
    with open(os.path.join(args.report, f"rank-{distribution.rank}.json"), "w") as file:
        json.dump(figures, file)
    # Every rank has reported: leave as the trainers do, without the
    # interpreter's teardown of TensorFlow and Horovod.
    exit_after_run(0)


# ---- Parent --------------------------------------------------------------------


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


def measure_zero(preset, stage, workers, batch_size=1, recompute=False, xla=False, steps=2,
                 sequence_length=0, timeout=1800):
    """Runs one horovodrun job of `workers` ranks at ZeRO `stage`; returns its figures.

    Returns a dict with the configuration, each rank's figures (`ranks`,
    what `zero_worker` wrote, in rank order), the seconds the job took, and
    in bytes per rank: `computed` (`state_bytes` of the largest rank) and the
    largest rank's `peak_rss`, `rss_before_step` and `runtime_rss`.
    """
    with tempfile.TemporaryDirectory() as report, tempfile.TemporaryFile("w+") as output:
        argv = [HOROVODRUN, "-np", str(workers), "--gloo", "-H", f"localhost:{workers}",
                sys.executable, "-m", "bench.memory", "worker", "--preset", preset,
                "--batch-size", str(batch_size), "--steps", str(steps),
                "--sequence-length", str(sequence_length), "--zero-stage", str(stage),
                "--report", report]
        if recompute:
            argv.append("--recompute")
        if xla:
            argv.append("--xla")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
        start = time.monotonic()
        # Its own session, so that a job past its time is stopped with its ranks.
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=output,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeError(
                f"{preset} stage {stage} on {workers} worker(s) took more than {timeout} s"
            ) from None
        seconds = time.monotonic() - start
        output.seek(0)
        log = output.read()
        paths = [os.path.join(report, f"rank-{rank}.json") for rank in range(workers)]
        if process.returncode != 0 or not all(os.path.exists(path) for path in paths):
            raise RuntimeError(
                f"{preset} stage {stage} on {workers} worker(s) failed "
                f"(exit {process.returncode}):\n{log[-3000:]}"
            )
        ranks = []
        for path in paths:
            with open(path) as file:
                ranks.append(json.load(file))
    largest = lambda key: 1024 * max(rank[key] for rank in ranks)  # noqa: E731
    return {
        "preset": preset,
        "workers": workers,
        "stage": stage,
        "batch_size": batch_size,
        "sequence_length": ranks[0]["sequence_length"],
        "recompute": recompute,
        "xla": xla,
        "steps": steps,
        "parameters": ranks[0]["parameters"],
        "largest_unit": ranks[0]["largest_unit"],
        "computed": max((rank["state_bytes"] for rank in ranks), key=lambda b: b["total"]),
        "peak_rss": largest("high_water_kib"),
        "rss_before_step": largest("rss_before_step_kib"),
        "runtime_rss": largest("runtime_rss_kib"),
        "job_seconds": seconds,
        "ranks": ranks,
    }


def _step_figures(row):
    """'peak / after' in GiB for each step, the largest rank's of each."""
    figures = []
    for steps in zip(*(rank["steps"] for rank in row["ranks"])):
        peaks = [step["peak_above_entry_kib"] for step in steps]
        peak = "?" if None in peaks else f"{max(peaks) / 2**20:.2f}"
        figures.append(f"{peak} / {max(step['rss_after_kib'] for step in steps) / 2**20:.2f}")
    return figures


def zero_table(rows):
    """The ZeRO table: per rank, computed and measured, each against stage 0 (GiB)."""
    baseline = {(row["preset"], row["workers"]): row for row in rows if row["stage"] == 0}

    def ratio(row, value):
        base = baseline.get((row["preset"], row["workers"]))
        return f"{value(row) / value(base):.2f}x" if base else "-"

    gib = lambda count: f"{count / GIB:.2f}"  # noqa: E731
    print_table(
        ["preset", "workers", "stage", "computed state", "vs 0", "computed total", "vs 0",
         "peak RSS", "vs 0", "runtime", "before step", "rest"],
        [[row["preset"], row["workers"], row["stage"],
          gib(row["computed"]["state"]), ratio(row, lambda r: r["computed"]["state"]),
          gib(row["computed"]["total"]), ratio(row, lambda r: r["computed"]["total"]),
          gib(row["peak_rss"]), ratio(row, lambda r: r["peak_rss"]),
          gib(row["runtime_rss"]), gib(row["rss_before_step"]),
          gib(row["peak_rss"] - row["runtime_rss"] - row["computed"]["total"])]
         for row in rows],
    )
    print("GiB per rank; computed: tfgpt.parallel.zero.state_bytes (state: parameters, "
          "gradients, AdamW moments; total: + stage 3's largest gathered unit); peak RSS: the "
          "largest rank's VmHWM; runtime: its RSS before building the model; rest: peak - "
          "runtime - computed total; vs 0: against stage 0 at the same workers")


def budget_rows(rows, budget_gib):
    """Per measured (preset, workers, stage): the deepest GPT that fits `budget_gib`."""
    from tfgpt.config import GPT_PRESETS

    result = []
    for row in rows:
        fields = GPT_PRESETS[row["preset"]]
        parameters, unit = gpt_parameters(fields)
        if (parameters, unit if row["stage"] == 3 else 0) != (
            row["parameters"], row["largest_unit"]
        ):
            raise RuntimeError(
                f"gpt_parameters({row['preset']}) = {parameters:,}, largest unit {unit:,}; "
                f"the model built had {row['parameters']:,} and {row['largest_unit']:,}"
            )
        depth = budget_depth(fields, row["stage"], row["workers"], int(budget_gib * GIB),
                             row["runtime_rss"])
        result.append({"preset": row["preset"], "workers": row["workers"], "stage": row["stage"],
                       "budget_gib": budget_gib, "overhead": row["runtime_rss"], **depth})
    return result


def budget_table(rows):
    print_table(
        ["preset", "workers", "stage", "overhead GiB", "num_layers", "parameters", "total GiB"],
        [[row["preset"], row["workers"], row["stage"], f"{row['overhead'] / GIB:.2f}",
          row["num_layers"], f"{row['parameters'] / 1e6:,.0f}M", f"{row['total'] / GIB:.2f}"]
         for row in rows],
    )
    print(f"deepest GPT of each preset's width whose computed total per rank plus the overhead "
          f"fits {rows[0]['budget_gib']:g} GiB; overhead: the largest rank's resident set before "
          "it built the model (Python, TensorFlow, Horovod, Gloo), measured in that "
          "configuration's run; computed, not run, for every depth; activations and the step's "
          "temporaries are not counted (the table's rest column shows how large they were)")


def main(argv=None):
    from tfgpt.cli import HelpFormatter
    from tfgpt.config import GPT_PRESETS
    from tfgpt.config.distribution import ZERO_STAGES

    parser = argparse.ArgumentParser(
        prog="python bench/memory.py", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--presets", nargs="+", default=["gpt-mini", "gpt2-small"], choices=list(GPT_PRESETS),
        metavar="PRESET", help=f"GPT presets to measure: each with and without recomputation, or with "
        f"--zero-stage as --recompute says (choices: {', '.join(GPT_PRESETS)})",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step (per rank)")
    parser.add_argument("--sequence-length", type=int, default=0, metavar="T",
                        help="tokens per sequence; 0: each preset's context")
    parser.add_argument("--steps", type=int, default=2, help="training steps per process")
    parser.add_argument("--xla", action="store_true", help="compile the steps with XLA")
    parser.add_argument(
        "--zero-stage", type=int, nargs="+", choices=ZERO_STAGES, metavar="S",
        help="measure these ZeRO stages instead, each preset, stage and --workers count one "
        f"horovodrun job (choices: {', '.join(map(str, ZERO_STAGES))}; 0: whole state on "
        "every rank, the ratios' baseline)",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1], metavar="N",
                        help="with --zero-stage: horovodrun -np N for each N")
    parser.add_argument("--recompute", action="store_true",
                        help="with --zero-stage: recompute the blocks in every run (stage 3 "
                        "gathers their weights again in the backward pass instead of keeping "
                        "them)")
    parser.add_argument("--budget-gb", type=float, metavar="G",
                        help="with --zero-stage: for each configuration measured, the deepest "
                        "GPT of its preset's width whose computed state per rank plus the "
                        "measured runtime fits G GiB")
    parser.add_argument("--timeout", type=float, default=1800, metavar="SECONDS",
                        help="with --zero-stage: stop a horovodrun job after this long")
    parser.add_argument(
        "--out", default=os.path.join(REPO, "bench", "results"), metavar="DIR",
        help="directory for memory.json (with --zero-stage: memory-zero.json)",
    )
    args = parser.parse_args(argv)
    if args.zero_stage is None:
        for flag, value in (("--workers", args.workers != [1]), ("--recompute", args.recompute),
                            ("--budget-gb", args.budget_gb)):
            if value:
                parser.error(f"{flag} applies to --zero-stage runs (without it every preset "
                             "runs on one process, with and without recomputation)")
        rows = []
        for preset in args.presets:
            for recompute in (False, True):
                row = measure(preset, args.batch_size, recompute, xla=args.xla, steps=args.steps,
                              sequence_length=args.sequence_length)
                print(f"{preset:12s} recompute={str(recompute):5s} peak RSS "
                      f"{row['peak_rss_mib']:8.0f} MiB  step {row['step_peak_mib']:8.0f} MiB",
                      flush=True)
                rows.append(row)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "memory.json"), "w") as file:
            json.dump(rows, file, indent=2)
        return

    if any(count < 1 for count in args.workers):
        parser.error(f"--workers must be positive. Received: {args.workers}")
    if args.budget_gb is not None and not args.budget_gb > 0:
        parser.error(f"--budget-gb must be positive. Received: {args.budget_gb}")
    rows = []
    for preset in args.presets:
        for count in args.workers:
            for stage in args.zero_stage:
                row = measure_zero(preset, stage, count, args.batch_size, args.recompute,
                                   xla=args.xla, steps=args.steps,
                                   sequence_length=args.sequence_length, timeout=args.timeout)
                print(f"{preset:12s} workers={count} stage={stage} computed total "
                      f"{row['computed']['total'] / GIB:6.2f} GiB  peak RSS "
                      f"{row['peak_rss'] / GIB:6.2f} GiB  ({row['job_seconds']:.0f} s)",
                      flush=True)
                print("  per step, the largest rank's peak above its resident set on entry / "
                      "resident set after: " + ", ".join(_step_figures(row)), flush=True)
                rows.append(row)
    print()
    zero_table(rows)
    record = {"rows": rows}
    if args.budget_gb is not None:
        record["budget"] = budget_rows(rows, args.budget_gb)
        print()
        budget_table(record["budget"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory-zero.json"), "w") as file:
        json.dump(record, file, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        main()
