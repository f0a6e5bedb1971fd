"""Peak resident memory per rank of `train_hvd.py` runs, one layout against another.

Each layout is one `horovodrun -np N --gloo -H localhost:N` run of
train_hvd.py itself with the flags given after `--` plus the layout's
own. Every rank runs as `python -m bench.layout_memory rank FILE ...`:
train_hvd's `main`, then, before the process ends, its VmHWM (the peak
resident set of that process: Python, TensorFlow, Horovod, the model's
weights, gradients and optimizer state, the steps' activations) is
written to FILE-R.json for rank R. The table shows each layout's largest
and smallest rank and the largest against the first layout's.

Usage:
    python -m bench.layout_memory --data data/bench --out runs/layout-memory \\
        --layout DP2= --layout "PP2=--pipeline-parallel 2 --microbatches 2" \\
        -- --preset gpt2-medium --vocabulary-size 50257 --steps 2 --batch-size 2
"""

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from bench import print_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
MIB = 2**20


def _peak_bytes():
    """This process's VmHWM, in bytes (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def rank_main(prefix, argv):
    """One rank: train_hvd.py's run, then its peak resident set to `prefix`-R.json."""
    sys.path.insert(0, REPO)
    import train_hvd
    from tfgpt.training.front_end import exit_after_run

    status = train_hvd.main(argv)
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    with open(f"{prefix}-{rank}.json", "w") as file:
        json.dump({"rank": rank, "peak_bytes": _peak_bytes(), "status": status}, file)
    exit_after_run(status)


def measure(name, layout_flags, train_flags, ranks, data, out, timeout):
    """`{"layout", "peaks", "seconds"}` of one layout's run (peaks by rank)."""
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    prefix = os.path.join(run_dir, "peak")
    command = [
        HOROVODRUN, "-np", str(ranks), "--gloo", "-H", f"localhost:{ranks}",
        sys.executable, "-m", "bench.layout_memory", "rank", prefix,
        "--data", data, "--out", os.path.join(run_dir, "run"), *train_flags, *layout_flags,
    ]
    print(f"[layout_memory] {name}: {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, timeout=timeout, capture_output=True,
                               text=True)
    seconds = time.perf_counter() - start
    if completed.returncode != 0:
        sys.stderr.write(completed.stdout[-4000:] + completed.stderr[-4000:])
        raise SystemExit(f"[layout_memory] {name} failed (exit {completed.returncode})")
    peaks = {}
    for path in glob.glob(prefix + "-*.json"):
        with open(path) as file:
            record = json.load(file)
        peaks[record["rank"]] = record["peak_bytes"]
    if len(peaks) != ranks:
        raise SystemExit(f"[layout_memory] {name}: {len(peaks)} of {ranks} ranks reported")
    return {"layout": name, "flags": layout_flags, "peaks": peaks, "seconds": seconds}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        return rank_main(argv[1], argv[2:])
    train_flags = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_flags = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(
        description="Peak resident memory per rank of train_hvd.py under several layouts.")
    parser.add_argument("--data", required=True, help="a prepared data directory")
    parser.add_argument("--out", default="runs/layout-memory", help="where the runs go")
    parser.add_argument("--ranks", type=int, default=2, help="horovodrun -np")
    parser.add_argument("--layout", action="append", required=True, metavar="NAME=FLAGS",
                        help="a layout's name and its train_hvd.py flags (repeat; the "
                             "first is the reference)")
    parser.add_argument("--timeout", type=float, default=3600, metavar="SECONDS")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    layouts = []
    for item in args.layout:
        name, separator, flags = item.partition("=")
        if not separator or not name:
            parser.error(f"--layout takes NAME=FLAGS. Received: {item!r}")
        layouts.append((name, shlex.split(flags)))
    rows = [measure(name, flags, train_flags, args.ranks, args.data, args.out, args.timeout)
            for name, flags in layouts]
    reference = max(rows[0]["peaks"].values())
    print_table(
        ["layout", "largest rank's peak RSS (MiB)", "smallest rank's (MiB)", "largest / first's",
         "run (s)"],
        [[row["layout"], f"{max(row['peaks'].values()) / MIB:,.0f}",
          f"{min(row['peaks'].values()) / MIB:,.0f}",
          f"{max(row['peaks'].values()) / reference:.2f}", f"{row['seconds']:.0f}"]
         for row in rows])
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
