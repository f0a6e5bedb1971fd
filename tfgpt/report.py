"""A run's summary from its run directory: loss, speed, time split per worker, rules.

Usage:
    python -m tfgpt.report runs/demo [--plot runs/demo/report.png | --no-plot]

Reads `metrics.jsonl` (and `config.json` when present) and prints:

- the run: family, workers, steps logged;
- the loss from the first to the last logged window, and the validation
  loss (with the unigram baseline for language models);
- throughput: the median tokens/s and MFU of the windows after the first
  (which holds tracing and start-up);
- the time split (`tfgpt.observe.monitor`) per worker, each share's mean
  over the same windows, with the worker's CPU % and its resident set at
  the first and last window;
- the rules that fired, with their step and message.

and writes a PNG of the loss and of the time split over the steps
(matplotlib; without it, says so and writes none). Imports no TensorFlow.
"""

import argparse
import json
import os
import statistics
import sys

from tfgpt.cli import HelpFormatter
from tfgpt.observe.monitor import SHARES


def read_run(run_dir):
    """`(records, config)` of a run directory; ValueError naming what is missing."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir} has no metrics.jsonl: not a tfgpt run directory, or the "
                         "run has not logged a window yet")
    records = []
    with open(path) as file:
        for number, line in enumerate(file, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
    config = {}
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as file:
            config = json.load(file)
    return records, config


def summarize(records, config):
    """The figures `main` prints, as a dict (see the module docstring)."""
    train = [r for r in records if r.get("split") == "train"]
    validation = [r for r in records if r.get("split") == "val"]
    if not train:
        raise ValueError("metrics.jsonl has no training window")
    timed = train[1:] or train
    summary = {
        "family": config.get("family"),
        "workers": config.get("workers"),
        "first_step": train[0]["step"], "last_step": train[-1]["step"],
        "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
        "validation": validation[-1] if validation else None,
    }
    for name in ("tokens_per_second", "mfu"):
        values = [r[name] for r in timed if name in r]
        summary[name] = statistics.median(values) if values else None
    workers = {}
    for record in timed:
        for row in record.get("workers", []):
            workers.setdefault(row["rank"], []).append(row)
    summary["split"] = {
        rank: {
            **{part: statistics.fmean(row[part] for row in rows) for part in SHARES},
            "cpu_percent": statistics.fmean(row["cpu_percent"] for row in rows),
            "rss_first": rows[0]["rss_mib"], "rss_last": rows[-1]["rss_mib"],
        }
        for rank, rows in sorted(workers.items())
    }
    summary["rules"] = [
        {"step": record["step"], **fired} for record in train for fired in record.get("rules", [])
    ]
    return summary


def format_summary(run_dir, summary):
    lines = [f"run {run_dir}: {summary['family'] or '?'}, {summary['workers'] or '?'} worker(s), "
             f"windows logged at steps {summary['first_step']}-{summary['last_step']}"]
    lines.append(f"loss {summary['first_loss']:.4f} at step {summary['first_step']} -> "
                 f"{summary['last_loss']:.4f} at step {summary['last_step']}")
    if summary["validation"]:
        validation = summary["validation"]
        baseline = validation.get("unigram_entropy")
        lines.append(f"validation loss {validation['loss']:.4f} at step {validation['step']}"
                     + (f" (unigram baseline {baseline:.4f})" if baseline is not None else ""))
    if summary["tokens_per_second"] is not None:
        lines.append(f"throughput {summary['tokens_per_second']:,.0f} tokens/s, MFU "
                     f"{summary['mfu']:.1%} (medians of the windows after the first)")
    if summary["split"]:
        lines.append("time split per worker (means of the windows after the first):")
        lines.append("| rank | data | compute | communication | other | CPU % | RSS MiB first -> last |")
        lines.append("|---|---|---|---|---|---|---|")
        for rank, split in summary["split"].items():
            lines.append(
                f"| {rank} | " + " | ".join(f"{split[part]:.1%}" for part in SHARES)
                + f" | {split['cpu_percent']:.0f} | {split['rss_first']:.0f} -> "
                f"{split['rss_last']:.0f} |"
            )
    else:
        lines.append("time split: not logged by this run")
    if summary["rules"]:
        lines.append("rules that fired:")
        lines += [f"  step {fired['step']}: {fired['message']}" for fired in summary["rules"]]
    else:
        lines.append("rules that fired: none")
    return "\n".join(lines)


def plot(records, path):
    """Writes the loss and the mean time split over the steps to `path`; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [r for r in records if r.get("split") == "train"]
    validation = [r for r in records if r.get("split") == "val"]
    figure, (losses, split) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    losses.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if validation:
        losses.plot([r["step"] for r in validation], [r["loss"] for r in validation], "o",
                    label="validation")
    losses.set_ylabel("loss")
    losses.legend()
    timed = [r for r in train if "time_compute" in r]
    if timed:
        split.stackplot([r["step"] for r in timed],
                        *[[100 * r[f"time_{part}"] for r in timed] for part in SHARES],
                        labels=SHARES)
        split.set_ylim(0, 100)
        split.legend(loc="lower right")
    split.set_ylabel("% of the window, mean over workers")
    split.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tfgpt.report", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (--out of a run)")
    parser.add_argument("--plot", metavar="PNG",
                        help="where to write the plot (default: RUN_DIR/report.png)")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    args = parser.parse_args(argv)
    try:
        records, config = read_run(args.run_dir)
        summary = summarize(records, config)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(format_summary(args.run_dir, summary))
    if not args.no_plot:
        path = args.plot or os.path.join(args.run_dir, "report.png")
        if plot(records, path):
            print(f"plot: {path}")
        else:
            print("plot: none (matplotlib is not installed: pip install matplotlib)",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
