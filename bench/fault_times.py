"""How long a 2-rank run takes to end when one rank stops or hangs: docs/faults.md's figures.

Each case is `horovodrun -np 2` of `train_hvd.py` on a 2-layer, 32-wide
gpt (batch 4 x 16 tokens, vocabulary 512, a checkpoint every 2 steps) with one of
`tfgpt.resilience.faults`' test-only faults on rank 1 at step 3: SIGSTOP
(`stopped`) or a hang in Python between steps (`hung`). Printed per case:
seconds from the last step logged (step 2) to the end of horovodrun, and
the line that ended the run. The data is the built-in corpus, prepared
once into `--work`. A bench, not a test: it prints, it asserts nothing
(the claims are `tests/test_peer_death.py`'s).

    python -m bench.fault_times --collective-timeout 8
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = ["--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
         "--intermediate-dim", "48", "--max-sequence-length", "16"]
CASES = {
    "data-shared-memory-stopped": ([], "STOP"),
    "data-horovod-stopped": (["--allreduce-transport", "horovod"], "STOP"),
    "zero3-stopped": (["--zero-stage", "3"], "STOP"),
    "tensor-stopped": (["--tensor-parallel", "2"], "STOP"),
    "pipeline-stopped": (["--pipeline-parallel", "2", "--microbatches", "2",
                          "--num-layers", "3"], "STOP"),
    "zero3-hung": (["--zero-stage", "3"], "HANG"),
}


def prepare(work):
    data = work / "data"
    if not (data / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "pipelines.prepare", "--output", str(data),
                        "--seq-len", "16", "--vocab-size", "512", "--shard-size", "64K"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return data


def time_case(name, data, work, timeout):
    flags, fault = CASES[name]
    out = Path(tempfile.mkdtemp(prefix=name + "-", dir=work))
    horovodrun = Path(sys.executable).parent / "horovodrun"
    command = [str(horovodrun), "-np", "2", "--gloo", "-H", "localhost:2", sys.executable,
               str(REPO / "train_hvd.py"), "--data", str(data), "--out", str(out),
               "--steps", "8", "--batch-size", "4", "--log-every", "1", "--eval-batches", "1",
               "--save-every", "2", "--collective-timeout", str(timeout), *MODEL, *flags]
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                       HOROVOD_GLOO_TIMEOUT_SECONDS=str(max(30, 3 * timeout)),
                       **{f"TFGPT_FAULT_{fault}_AT_STEP": "1:3"})
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=environment, cwd=REPO, start_new_session=True)
    logged, ended_by = None, []
    for line in process.stdout:
        if "train step      2 " in line:
            logged = time.monotonic()
        if "error: rank " in line:
            ended_by.append(line.strip())
    process.wait()
    seconds = time.monotonic() - logged if logged else float("nan")
    return seconds, ended_by


def main(argv=None):
    from tfgpt.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="python -m bench.fault_times", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--collective-timeout", type=float, default=8.0,
                        help="train_hvd.py's --collective-timeout, seconds")
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), default=sorted(CASES),
                        help="the cases to run, each one horovodrun")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "fault-times",
                        help="where the data is prepared (once) and the runs write")
    args = parser.parse_args(argv)
    from tfgpt.observe.flops import processor_name  # TensorFlow: after the flags

    args.work.mkdir(parents=True, exist_ok=True)
    data = prepare(args.work)
    print(f"machine: {processor_name()}, {os.cpu_count()} CPUs; "
          f"--collective-timeout {args.collective_timeout:g}", flush=True)
    for name in args.cases:
        seconds, ended_by = time_case(name, data, args.work, args.collective_timeout)
        print(f"{name}: {seconds:.1f} s from step 2 logged to the end", flush=True)
        for line in ended_by:
            print(f"    {line}", flush=True)


if __name__ == "__main__":
    main()
