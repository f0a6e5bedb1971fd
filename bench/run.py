"""tfgpt's benchmarks in one command: a table, bench/results/*.json and a plot.

    python -m bench.run --quick      # gpt-mini, a few minutes on 2 idle cores
    python -m bench.run              # gpt-mini and gpt-demo, torch.compile, more rounds
    python -m bench.run --sections training memory

Sections (each also runs alone: `python -m bench.<module> --help`):

training    tfgpt's TrainStep (fp32, bf16; XLA on and off) against the plain
            PyTorch GPT of bench/torch_gpt.py (eager; torch.compile in the
            full run) on the same NumPy token batches with the same threads,
            and the fp32/bf16 matmul peak: each configuration in its own
            process, interleaved round by round (bench/throughput.py).
            tokens/s, sequences/s, MFU and the tfgpt/PyTorch ratio.
scaling     T(2)/(2 T(1)) for train_hvd.py under horovodrun and for
            train_mirrored.py with two MultiWorkerMirrored workers, one
            thread per worker (bench/scaling.py).
memory      peak RSS of training steps at batch 1, gpt-mini and gpt2-small,
            with and without --recompute (bench/memory.py).
generation  cached vs uncached decoding tokens/s (bench/generation.py).
pipeline    reader tokens/s against gpt-mini's training consumption
            (bench/pipeline.py).

MFU = achieved model FLOPs / measured peak, with model FLOPs per token
6 N + 12 L C T (N: parameters used in matmuls, the position table left out;
L layers, C width, T context: attention's QK^T and AV, causal half not
subtracted; tfgpt/observe/flops.py), and the peak measured in the same run
by a chain of 2048 x 2048 matmuls in TensorFlow in the same dtype and
threads. "tokens/CPU-s" divides by the CPU time the worker used instead of
wall time: on a machine shared with other jobs it shows the work per token
when wall-clock figures are mostly the neighbours' load.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from bench import print_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
SECTIONS = ("training", "scaling", "memory", "generation", "pipeline")

QUICK_TRAINING = [
    "tfgpt fp32", "tfgpt fp32 towers1", "tfgpt fp32 xla", "tfgpt bf16", "tfgpt bf16 towers1",
    "tfgpt bf16 xla",
    "torch fp32", "torch bf16", "peak fp32", "peak bf16",
]
FULL_TRAINING = QUICK_TRAINING + ["torch fp32 compile", "torch bf16 compile"]


def _load():
    return os.getloadavg()[0]


# ---- Sections -----------------------------------------------------------------


def training_section(args, work):
    from bench import throughput

    names = FULL_TRAINING if not args.quick else QUICK_TRAINING
    presets = ["gpt-mini"] if args.quick else ["gpt-mini", "gpt-demo"]
    figures = {}
    # One thread as well as all cores: on a machine shared with other jobs,
    # PyTorch's OpenMP pool loses far more to a descheduled thread than
    # TensorFlow's, so only the one-thread table compares the frameworks fairly.
    threads_list = args.threads or sorted({os.cpu_count() or 1, 1}, reverse=True)
    for preset, threads in [(p, t) for p in presets for t in threads_list]:
        batch_size = 8 if preset == "gpt-mini" else 16
        print(f"\n== training: {preset}, batch {batch_size}, {threads} thread(s), "
              f"{args.rounds} rounds x {args.steps_per_round} steps (load {_load():.1f})", flush=True)
        measurement = throughput.measure(
            names, preset, batch_size, args.rounds, args.steps_per_round, threads,
            os.path.join(work, "throughput"), log=lambda message: print(message, flush=True),
        )
        figures[f"{preset}, {threads} thread(s)"] = measurement
        results = measurement["results"]
        rows = []
        for name in names:
            if name.startswith("peak"):
                continue
            result = results[name]
            precision = "bf16" if "bf16" in name else "fp32"
            reference = f"torch {precision}"
            rows.append([
                name,
                f"{result['median']:,.0f}",
                f"{result['sequences_per_second']:.2f}",
                f"{result['tokens_per_cpu_second']:,.0f}",
                f"{throughput.mfu(measurement, name, 'peak ' + precision):.0%}",
                f"{throughput.mfu(measurement, name, 'peak fp32'):.0%}",
                f"{throughput.ratio(measurement, name, reference):.2f}" if name != reference else "1",
            ])
        print_table(["configuration", "tokens/s", "seq/s", "tokens/CPU-s", "MFU", "MFU vs fp32 peak",
                      "x torch eager"], rows)
        peaks = {name: results[name]["median"] / 1e9 for name in ("peak fp32", "peak bf16")}
        print(f"matmul peak (2048^2 chain, TF): fp32 {peaks['peak fp32']:.0f} GFLOP/s, "
              f"bf16 {peaks['peak bf16']:.0f} GFLOP/s; model "
              f"{results['tfgpt fp32']['flops_per_token'] / 1e6:.1f} MFLOP/token "
              f"(tfgpt) / {results['torch fp32']['flops_per_token'] / 1e6:.1f} (torch)")
        for precision in ("fp32", "bf16"):
            print(f"XLA on/off, {precision}: "
                  f"{throughput.ratio(measurement, f'tfgpt {precision} xla', f'tfgpt {precision}'):.2f}"
                  " (median of per-round ratios)")
    return figures


def scaling_section(args, work):
    from bench import scaling

    print(f"\n== scaling: gpt-mini, 8 sequences per worker, 1 thread per worker (load {_load():.1f})",
          flush=True)
    data = scaling.ensure_data(os.path.join(work, "data-256"))
    figures = scaling.measure(
        data, os.path.join(work, "scaling"), steps=20 if args.quick else 40, log_every=5,
        rounds=1 if args.quick else 2, log=lambda message: print(message, flush=True),
        extra=["--xla"] if args.xla_trainers else [],
    )
    rows = [[kind, " / ".join(f"{t:,.0f}" for t in r["tokens_per_second_1"]),
             " / ".join(f"{t:,.0f}" for t in r["tokens_per_second_2"]),
             " / ".join(f"{e:.0%}" for e in r["efficiency_per_round"])]
            for kind, r in figures["results"].items()]
    print_table(["trainer", "T(1) tokens/s", "T(2) tokens/s", "T(2)/(2 T(1)) per round"], rows)
    return figures


def memory_section(args, work):
    from bench import memory

    print(f"\n== memory: training steps at batch 1 (load {_load():.1f})", flush=True)
    rows, figures = [], []
    presets = [("gpt-mini", 0), ("gpt2-small", 0)]
    for preset, length in presets:
        for recompute in (False, True):
            row = memory.measure(preset, 1, recompute, xla=args.xla_trainers, sequence_length=length)
            figures.append(row)
            rows.append([preset, f"{row['sequence_length']}", "on" if recompute else "off",
                         f"{row['peak_rss_mib']:,.0f}", f"{row['step_peak_mib']:,.0f}"])
            print(f"  {preset} recompute={recompute}: {row['peak_rss_mib']:,.0f} MiB", flush=True)
    print_table(["model", "context", "recompute", "peak RSS MiB", "step adds MiB"], rows)
    return figures


def generation_section(args, work):
    print(f"\n== generation: gpt-mini, batch 1 (bench/generation.py, load {_load():.1f})", flush=True)
    path = os.path.join(work, "generation.json")
    new_tokens = ["32", "128"] if args.quick else ["32", "256", "1024"]
    command = [sys.executable, os.path.join(REPO, "bench", "generation.py"),
               "--new-tokens", *new_tokens, "--json", path]
    if not args.quick:
        command.append("--xla")
    _run_and_echo(command)
    with open(path) as file:
        return json.load(file)


def pipeline_section(args, work):
    print(f"\n== input pipeline (bench/pipeline.py, load {_load():.1f})", flush=True)
    path = os.path.join(work, "pipeline.json")
    command = [sys.executable, os.path.join(REPO, "bench", "pipeline.py"), "--json", path,
               "--workdir", os.path.join(work, "pipeline")]
    if args.quick:
        command += ["--corpus-mb", "4", "--reader-seconds", "3", "--train-steps", "3", "--repeats", "1"]
    _run_and_echo(command)
    with open(path) as file:
        return json.load(file)


def _run_and_echo(command):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    process = subprocess.run(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    print(process.stdout, end="", flush=True)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{process.stderr[-3000:]}")


# ---- Plot ---------------------------------------------------------------------


def plot(figures, path):
    """Training tokens/s per configuration, generation tokens/s against the
    number of new tokens, and peak RSS; returns the path or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install -r requirements-test.txt)")
        return None
    panels = [key for key in ("training", "generation", "memory") if key in figures]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for axis, panel in zip(axes[0], panels):
        if panel == "training":
            measurement = next(iter(figures["training"].values()))
            names = [n for n in measurement["results"] if not n.startswith("peak")]
            values = [measurement["results"][n]["median"] for n in names]
            colors = ["tab:blue" if n.startswith("tfgpt") else "tab:orange" for n in names]
            axis.barh(names, values, color=colors)
            for name, result in measurement["results"].items():
                if not name.startswith("peak"):
                    axis.plot(result["tokens_per_second"], [name] * len(result["tokens_per_second"]),
                              "k.", markersize=3)
            axis.set_xlabel("tokens/s (bars: median; dots: rounds)")
            axis.set_title(f"training {measurement['preset']}, batch {measurement['batch_size']} x "
                           f"{measurement['sequence_length']}, {measurement['threads']} threads")
            axis.invert_yaxis()
        elif panel == "generation":
            rows = figures["generation"]["results"]
            tokens = [row["new_tokens"] for row in rows]
            for key, label in (("cached", "KV cache"), ("uncached", "no cache"),
                               ("cached_xla", "KV cache + XLA")):
                if all(key in row for row in rows):
                    axis.plot(tokens, [row[key] for row in rows], "o-", label=label)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("new tokens")
            axis.set_ylabel("tokens/s")
            axis.set_title("generation gpt-mini, batch 1")
            axis.legend()
        else:
            rows = figures["memory"]
            labels = [f"{r['preset']}\n{'recompute' if r['recompute'] else 'plain'}" for r in rows]
            axis.bar(labels, [r["peak_rss_mib"] for r in rows],
                     color=["tab:green" if r["recompute"] else "tab:gray" for r in rows])
            axis.set_ylabel("peak RSS of a training process, MiB")
            axis.set_title("memory at batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    from tfgpt.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="gpt-mini only, fewer rounds")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
        help=f"tables to measure (choices: {', '.join(SECTIONS)})",
    )
    parser.add_argument("--threads", type=int, nargs="+", default=None, metavar="N",
                        help="TF intra-op threads = torch.set_num_threads for the training "
                        "tables; unset: all cores, then 1")
    parser.add_argument(
        "--rounds", type=int, default=None,
        help="interleaved rounds of the training tables; unset: 4 with --quick, else 8",
    )
    parser.add_argument(
        "--steps-per-round", type=int, default=None, metavar="N",
        help="timed steps per configuration and round; unset: 1 with --quick, else 2",
    )
    parser.add_argument("--xla-trainers", action=argparse.BooleanOptionalAction, default=False,
                        help="run the scaling trainers and the memory steps with --xla "
                        "(the trainers' default is off)")
    parser.add_argument(
        "--out", default=RESULTS, metavar="DIR", help="directory for the JSON and PNG results"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (4 if args.quick else 8)
    args.steps_per_round = args.steps_per_round or (1 if args.quick else 2)
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)

    started = time.time()
    figures = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench.run", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "load_average_at_start": list(os.getloadavg())},
    }
    sections = {"training": training_section, "scaling": scaling_section,
                "memory": memory_section, "generation": generation_section,
                "pipeline": pipeline_section}
    for name in args.sections:
        if name == "pipeline" and not os.path.exists(os.path.join(REPO, "bench", "pipeline.py")):
            print("\n== input pipeline: bench/pipeline.py is not there yet; skipped")
            continue
        if name == "generation" and not os.path.exists(os.path.join(REPO, "bench", "generation.py")):
            print("\n== generation: bench/generation.py is not there yet; skipped")
            continue
        figures[name] = sections[name](args, work)
    figures["machine"]["load_average_at_end"] = list(os.getloadavg())
    figures["seconds"] = time.time() - started

    os.makedirs(args.out, exist_ok=True)
    suffix = "quick" if args.quick else "full"
    path = os.path.join(args.out, f"bench-{suffix}.json")
    with open(path, "w") as file:
        json.dump(figures, file, indent=2)
    print(f"\nwrote {path}")
    picture = plot(figures, os.path.join(args.out, f"bench-{suffix}.png"))
    if picture:
        print(f"wrote {picture}")
    print(f"load average (1 min) at start {figures['machine']['load_average_at_start'][0]:.1f}, "
          f"at end {figures['machine']['load_average_at_end'][0]:.1f}; {figures['seconds'] / 60:.0f} min")


if __name__ == "__main__":
    main()
