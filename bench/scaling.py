"""Scaling efficiency T(N) / (N * T(1)) of the real trainers, 1 vs 2 workers.

Horovod: `horovodrun -np 2 train_hvd.py --intra-op-threads 1` against
`python train_hvd.py --intra-op-threads 1` (one worker, one thread), the
same per-worker batch. tf.distribute: two MultiWorkerMirrored processes on
localhost (TF_CONFIG), one intra-op thread each, against `train_mirrored.py
--strategy default` with one intra-op thread. (train_mirrored.py leaves the
inter-op pool at its default size, so its "one thread" can still use both
cores for independent ops; train_hvd.py sets it to one as well.) Every run is a real trainer process
with a fixed `--peak-flops` (no time spent measuring a peak); T is the
median of the global tokens/s the trainer logs in metrics.jsonl, without
its first timed window. The configurations alternate within each round.

`--kinds independent` runs two one-worker `train_hvd.py` jobs side by side,
with no communication between them, against one alone: the ceiling that
sharing the machine (caches, memory bandwidth, clock) leaves for any
data-parallel run, before a byte is exchanged.

`--zero-stages S [S ...]` measures ZeRO's cost instead: `horovodrun -np 2
train_hvd.py --zero-stage S` for each stage, the stages alternating within
each round (their order reversed every other round), and prints each
stage's median tokens/s and its ratio to stage 0's in the same rounds.

`--baseline CHECKOUT` also runs the same trainers from another checkout (a
`git worktree` of the commit before a change), alternating with this
one's within each round, so both see the same machine.

Usage:
    python -m bench.scaling --steps 30 --rounds 1
    git worktree add --detach ../before HEAD~1
    python -m bench.scaling --kinds horovod --rounds 3 --baseline ../before
    python -m bench.scaling --zero-stages 0 1 2 3 --rounds 3
"""

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time

from tfgpt.config.distribution import localhost_cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def ensure_data(directory, sequence_length=256, vocabulary_size=2000):
    """Prepares the built-in corpus at gpt-mini's shape once."""
    if os.path.exists(os.path.join(directory, "manifest.json")):
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pipelines.prepare", "--output", directory,
         "--seq-len", str(sequence_length), "--vocab-size", str(vocabulary_size)],
        cwd=REPO, env=_environment(), check=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return directory


def _environment(repo=REPO, **extra):
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=repo, **extra)




def trainer_flags(data, out, preset, steps, batch_size, log_every, extra=()):
    return ["--data", data, "--out", out, "--preset", preset, "--steps", str(steps),
            "--batch-size", str(batch_size), "--log-every", str(log_every),
            "--intra-op-threads", "1", "--peak-flops", "1e11", "--eval-batches", "1",
            "--warmup-steps", "0", *extra]


class ThreadCpu:
    """CPU seconds of a job's trainer threads, by kind, sampled from /proc.

    Every `interval` seconds it reads the user+system time of each thread of
    the Python processes descended from `roots` (the trainers, not
    horovodrun or its shells) and keeps the last reading, so a thread that
    exits keeps what it had used. Kinds: `tensorflow` (TensorFlow's thread
    pools, named `tf_*`), `main` (each process's main thread: Python, the
    step dispatch) and `other` (unnamed native threads: Horovod's
    background thread and Gloo's transport loop in a Horovod job). Linux
    only; elsewhere the figures stay empty.
    """

    def __init__(self, roots, interval=0.5):
        import threading

        self._roots, self._interval = set(roots), interval
        self._seconds = {}  # (pid, tid) -> (kind, seconds)
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _processes(self):
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as file:
                        parents[int(entry)] = int(file.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
        found, frontier = set(), set(self._roots)
        while frontier:
            found |= frontier
            frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        return found

    def _sample(self):
        for pid in self._processes():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as file:
                    if b"train_" not in file.read():
                        continue
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as file:
                        name, fields = file.read().split(" (", 1)[1].rsplit(") ", 1)
                except (OSError, ValueError):
                    continue
                fields = fields.split()
                seconds = (int(fields[11]) + int(fields[12])) / self._ticks
                kind = ("main" if int(tid) == pid else
                        "tensorflow" if name.startswith("tf_") else "other")
                self._seconds[pid, int(tid)] = (kind, seconds)

    def _loop(self):
        if not os.path.isdir("/proc"):
            return
        while not self._stop.wait(self._interval):
            self._sample()

    def stop(self):
        """Stops sampling; returns {kind: CPU seconds} summed over the job."""
        self._stop.set()
        self._thread.join()
        totals = collections.Counter()
        for kind, seconds in self._seconds.values():
            totals[kind] += seconds
        return dict(totals)


def _run(commands, timeout, repo=REPO):
    """Runs the commands at once (the workers of one job); raises on failure.

    Returns the job's CPU seconds by kind of thread (`ThreadCpu`).
    """
    processes = [
        subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for command, env in commands
    ]
    cpu = ThreadCpu(process.pid for process in processes)
    outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    cpu_seconds = cpu.stop()
    for process, output in zip(processes, outputs):
        if process.returncode != 0:
            raise RuntimeError(f"trainer failed ({process.returncode}):\n{output[-3000:]}")
    return cpu_seconds


def _median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else 0.5 * (values[middle - 1] + values[middle])


def tokens_per_second(out):
    """Median global tokens/s logged by the trainer, first timed window dropped."""
    rates = []
    with open(os.path.join(out, "metrics.jsonl")) as file:
        for line in file:
            record = json.loads(line)
            if record.get("split") == "train" and "tokens_per_second" in record:
                rates.append(record["tokens_per_second"])
    rates = rates[1:] or rates
    return _median(rates), len(rates)


def run_job(kind, workers, data, work, preset, steps, batch_size, log_every, extra, timeout=1200,
            repo=REPO, label=""):
    """Runs one trainer job from the checkout `repo`; returns its global tokens/s."""
    out = os.path.join(work, f"{kind}-{workers}{label}")
    shutil.rmtree(out, ignore_errors=True)
    flags = trainer_flags(data, out, preset, steps, batch_size, log_every, extra)
    if kind == "independent" and workers > 1:
        # The ceiling: the same single-worker jobs side by side, no communication.
        script = [sys.executable, os.path.join(repo, "train_hvd.py")]
        outs = [os.path.join(out, str(index)) for index in range(workers)]
        cpu = _run([([*script, *trainer_flags(data, each, preset, steps, batch_size, log_every,
                                               extra)], _environment(repo)) for each in outs],
                   timeout, repo)
        rates = [tokens_per_second(each) for each in outs]
        return sum(rate for rate, _ in rates), min(windows for _, windows in rates), cpu
    if kind in ("horovod", "independent"):
        script = [sys.executable, os.path.join(repo, "train_hvd.py"), *flags]
        if workers > 1:
            script = [HOROVODRUN, "-np", str(workers), "--gloo", "-H", f"localhost:{workers}", *script]
        cpu = _run([(script, _environment(repo))], timeout, repo)
    else:
        script = [sys.executable, os.path.join(repo, "train_mirrored.py")]
        if workers == 1:
            cpu = _run([([*script, "--strategy", "default", *flags], _environment(repo))],
                       timeout, repo)
        else:
            cluster = localhost_cluster(workers)
            cpu = _run([
                ([*script, "--strategy", "multi-worker", *flags], _environment(
                    repo, TF_CONFIG=json.dumps(
                        {"cluster": cluster, "task": {"type": "worker", "index": index}})))
                for index in range(workers)
            ], timeout, repo)
    rate, windows = tokens_per_second(out)
    return rate, windows, cpu


def _load_average():
    try:
        with open("/proc/loadavg") as file:
            return float(file.read().split()[0])
    except OSError:  # not Linux
        return float("nan")


def measure(data, work, preset="gpt-mini", steps=30, batch_size=8, log_every=5, rounds=1,
            kinds=("horovod", "multi-worker"), extra=(), log=print, baseline=None):
    """Interleaved 1- and 2-worker runs per kind (and checkout); returns the figures.

    With `baseline` (a checkout directory), every kind also runs from
    there, reported as "KIND @baseline"; the two checkouts alternate.
    """
    sources = [("", REPO)] + ([(" @baseline", os.path.abspath(baseline))] if baseline else [])
    names = [kind + label for kind in kinds for label, _ in sources]
    rates = {(name, workers): [] for name in names for workers in (1, 2)}
    cpu_shares = {(name, workers): [] for name in names for workers in (1, 2)}
    load_averages = []
    for index in range(rounds):
        for kind in kinds:
            for label, repo in sources if index % 2 == 0 else sources[::-1]:
                for workers in (1, 2) if index % 2 == 0 else (2, 1):
                    start, load = time.perf_counter(), _load_average()
                    load_averages.append(load)
                    rate, windows, cpu = run_job(kind, workers, data, work, preset, steps,
                                                 batch_size, log_every, extra, repo=repo,
                                                 label=label.replace(" @", "-"))
                    rates[kind + label, workers].append(rate)
                    total = sum(cpu.values()) or float("nan")
                    shares = {thread: seconds / total for thread, seconds in cpu.items()}
                    cpu_shares[kind + label, workers].append(shares)
                    log(f"  {kind}{label} x{workers}: {rate:.0f} tokens/s ({windows} windows, "
                        f"{time.perf_counter() - start:.0f} s, load average {load:.2f} before; "
                        f"CPU {total:.0f} s: " + ", ".join(
                            f"{thread} {share:.1%}" for thread, share in sorted(shares.items()))
                        + ")")
    results = {}
    for kind in names:
        one, two = rates[kind, 1], rates[kind, 2]
        efficiencies = [t2 / (2 * t1) for t1, t2 in zip(one, two)]
        results[kind] = {
            "tokens_per_second_1": one,
            "tokens_per_second_2": two,
            "efficiency": _median(efficiencies),
            "efficiency_per_round": efficiencies,
            # Share of the job's CPU time per kind of thread (ThreadCpu), per round.
            "cpu_share_1": cpu_shares[kind, 1],
            "cpu_share_2": cpu_shares[kind, 2],
        }
    return {"preset": preset, "batch_size_per_worker": batch_size, "steps": steps,
            "log_every": log_every, "threads_per_worker": 1, "extra_flags": list(extra),
            "baseline": baseline, "load_average_1_min_before_runs": load_averages,
            "results": results}


def measure_zero(data, work, stages, preset="gpt-mini", steps=30, batch_size=8, log_every=5,
                 rounds=1, extra=(), workers=2, log=print):
    """Tokens/s of `horovodrun -np workers train_hvd.py --zero-stage S` per stage.

    The stages alternate within each round, reversed every other round.
    Returns the figures: per stage its tokens/s per round, the median, and
    the median of its per-round ratios to stage 0 (when 0 is measured).
    """
    rates = {stage: [] for stage in stages}
    load_averages = []
    for index in range(rounds):
        for stage in stages if index % 2 == 0 else stages[::-1]:
            start, load = time.perf_counter(), _load_average()
            load_averages.append(load)
            rate, windows, _ = run_job("horovod", workers, data, work, preset, steps, batch_size,
                                       log_every, [*extra, "--zero-stage", str(stage)],
                                       label=f"-zero{stage}")
            rates[stage].append(rate)
            log(f"  zero stage {stage} x{workers}: {rate:.0f} tokens/s ({windows} windows, "
                f"{time.perf_counter() - start:.0f} s, load average {load:.2f} before)")
    results = {}
    for stage in stages:
        results[stage] = {"tokens_per_second": rates[stage],
                          "median": _median(rates[stage])}
        if 0 in rates:
            ratios = [rate / base for rate, base in zip(rates[stage], rates[0])]
            results[stage]["ratio_per_round"] = ratios
            results[stage]["ratio_to_stage_0"] = _median(ratios)
    return {"preset": preset, "workers": workers, "batch_size_per_worker": batch_size,
            "steps": steps, "log_every": log_every, "threads_per_worker": 1,
            "extra_flags": list(extra), "load_average_1_min_before_runs": load_averages,
            "results": results}


def _warn_if_kernels_differ(baseline):
    library = os.path.join("tfgpt", "kernels", "_tfgpt_kernels.so")
    built = [os.path.exists(os.path.join(repo, library)) for repo in (REPO, baseline)]
    uses_kernels = os.path.isdir(os.path.join(baseline, "tfgpt", "kernels"))
    if uses_kernels and built[0] != built[1]:
        where = baseline if built[0] else REPO
        print(f"warning: {where} has no {library} and falls back to TensorFlow's ops "
              "(run `python -m tfgpt.kernels.build` there)", file=sys.stderr)


def main(argv=None):
    from tfgpt.cli import HelpFormatter
    from tfgpt.config import GPT_PRESETS
    from tfgpt.config.distribution import ZERO_STAGES

    kinds = ("horovod", "multi-worker", "independent")
    parser = argparse.ArgumentParser(
        prog="python -m bench.scaling", description=__doc__, formatter_class=HelpFormatter,
        epilog="Other flags are passed on to every trainer run.",
    )
    parser.add_argument("--preset", default="gpt-mini", choices=list(GPT_PRESETS),
                        help="GPT preset the trainers train")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step")
    parser.add_argument("--log-every", type=int, default=5, metavar="N",
                        help="steps per logged throughput window")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds; each runs every configuration once, alternating")
    parser.add_argument("--kinds", nargs="+", default=["horovod", "multi-worker"],
                        choices=kinds, metavar="KIND",
                        help=f"what to scale (choices: {', '.join(kinds)}; see above)")
    parser.add_argument("--work", default=os.path.join(REPO, "bench", "results", "work"),
                        metavar="DIR", help="scratch directory for the data and the runs")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results"), metavar="DIR",
                        help="directory for scaling.json")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also run the trainers from this checkout (a "
                        "directory, e.g. a `git worktree` of the commit before a change); build "
                        "its fused kernels there too (`python -m tfgpt.kernels.build`) or both "
                        "sides do not compute alike")
    parser.add_argument("--zero-stages", type=int, nargs="+", choices=ZERO_STAGES, metavar="S",
                        help="measure these ZeRO stages of horovodrun -np 2 train_hvd.py "
                        "instead (choices: "
                        f"{', '.join(map(str, ZERO_STAGES))}; ratios to stage 0 need 0)")
    args, extra = parser.parse_known_args(argv)
    if args.zero_stages and (args.baseline or args.kinds != parser.get_default("kinds")):
        parser.error("--zero-stages measures horovodrun -np 2 at each stage; it takes neither "
                     "--kinds nor --baseline")
    data = ensure_data(os.path.join(args.work, "data-256"))
    if args.zero_stages:
        stages = list(dict.fromkeys(args.zero_stages))
        figures = measure_zero(data, args.work, stages, args.preset, args.steps,
                               args.batch_size, args.log_every, args.rounds, extra)
        for stage, result in figures["results"].items():
            ratio = result.get("ratio_to_stage_0")
            print(f"zero stage {stage}: {result['median']:.0f} tokens/s"
                  + (f", {ratio:.3f}x stage 0 (rounds: " + ", ".join(
                      f"{r:.3f}" for r in result["ratio_per_round"]) + ")"
                     if ratio is not None else ""))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scaling-zero.json"), "w") as file:
            json.dump(figures, file, indent=2)
        return
    if args.baseline:
        _warn_if_kernels_differ(args.baseline)
    figures = measure(data, args.work, args.preset, args.steps, args.batch_size, args.log_every,
                      args.rounds, args.kinds, extra, baseline=args.baseline)
    for kind, result in figures["results"].items():
        rounds = ", ".join(f"{e:.2f}" for e in result["efficiency_per_round"])
        print(f"{kind}: scaling efficiency {result['efficiency']:.2f} (rounds: {rounds})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scaling.json"), "w") as file:
        json.dump(figures, file, indent=2)


if __name__ == "__main__":
    main()
