"""Training throughput: tfgpt against a PyTorch reference, interleaved.

Every configuration (framework x precision x compiler) lives in its own
worker process that builds its model, compiles and warms up once, then
waits. The driver then runs rounds: in each round every worker in turn
trains `steps_per_round` steps on the same pre-made token batches while the
others sleep on a pipe (an idle worker uses no CPU), and reports the
elapsed time. A slow spell of a shared machine thus hits every
configuration of a round alike; the table quotes medians over rounds and
the median of the per-round ratios.

One process per configuration also keeps TensorFlow's and PyTorch's thread
pools from spinning against each other, lets every worker set its own
dtype policy and threads before its framework starts, and lets a worker
import tfgpt from another checkout (`--tfgpt-path`) for before/after
comparisons of a change.

The matmul peak is measured by workers of the same kind, interleaved with
the rest: a chain of 2048x2048 matmuls in TensorFlow, float32 and bfloat16.

Worker protocol (stdin/stdout, one JSON object per line): the worker
prints {"ready": ...} after its warm-up, then answers each line `run K`
with {"seconds": ..., "loss": ...}; `quit` ends it.
"""

import argparse
import json
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What is compared; `threads` and the model come from the driver.
CONFIGURATIONS = {
    "tfgpt fp32": dict(framework="tf", precision="fp32", xla=False),
    "tfgpt fp32 xla": dict(framework="tf", precision="fp32", xla=True),
    "tfgpt bf16": dict(framework="tf", precision="bf16", xla=False),
    "tfgpt bf16 xla": dict(framework="tf", precision="bf16", xla=True),
    # TensorFlow's own (Eigen) kernels instead of oneDNN's: a setting read at import.
    "tfgpt fp32 no-onednn": dict(framework="tf", precision="fp32", xla=False,
                                 env={"TF_ENABLE_ONEDNN_OPTS": "0"}),
    # TensorFlow's composite ops instead of tfgpt's fused kernels (tfgpt.kernels).
    "tfgpt fp32 composite": dict(framework="tf", precision="fp32", xla=False,
                                 env={"TFGPT_FUSED_KERNELS": "0"}),
    "tfgpt bf16 composite": dict(framework="tf", precision="bf16", xla=False,
                                 env={"TFGPT_FUSED_KERNELS": "0"}),
    # One chain of ops, each on every thread (the trainers' default, --towers
    # 0, runs two half-batch towers side by side when there are 2+ threads).
    "tfgpt fp32 towers1": dict(framework="tf", precision="fp32", xla=False, towers=1),
    "tfgpt bf16 towers1": dict(framework="tf", precision="bf16", xla=False, towers=1),
    # Four quarter-batch towers on the same inter-op pool.
    "tfgpt fp32 towers4": dict(framework="tf", precision="fp32", xla=False, towers=4),
    "tfgpt bf16 towers4": dict(framework="tf", precision="bf16", xla=False, towers=4),
    # One chain, one inter-op thread: ops run one at a time, each on all threads.
    "tfgpt fp32 inter1": dict(framework="tf", precision="fp32", xla=False, inter_op_threads=1,
                              towers=1),
    "tfgpt bf16 inter1": dict(framework="tf", precision="bf16", xla=False, inter_op_threads=1,
                              towers=1),
    "torch fp32": dict(framework="torch", precision="fp32"),
    "torch bf16": dict(framework="torch", precision="bf16"),
    "torch fp32 compile": dict(framework="torch", precision="fp32", compile=True),
    "torch bf16 compile": dict(framework="torch", precision="bf16", compile=True),
    "peak fp32": dict(framework="peak", precision="fp32"),
    "peak bf16": dict(framework="peak", precision="bf16"),
}


# ---- Workers ------------------------------------------------------------------


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _serve(run_steps, ready):
    """Answers `run K` lines with the seconds K steps took."""
    _send({"ready": ready})
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            return
        count = int(command[1])
        cpu_start = _cpu_seconds()
        start = time.perf_counter()
        loss = run_steps(count)
        _send({"seconds": time.perf_counter() - start, "cpu_seconds": _cpu_seconds() - cpu_start,
               "loss": loss})


def _step_runner(step, batches):
    """`run_steps(count)`: `count` training steps cycling through `batches`; the last loss."""

    def run_steps(count):
        for index in range(count):
            metrics = step(*batches[index % len(batches)])
        return float(metrics["loss"])

    return run_steps


def _tf_worker(args, batches):
    if args.tfgpt_path:
        sys.path.insert(0, args.tfgpt_path)
    import keras
    import tensorflow as tf

    inter_op_threads = args.inter_op_threads or min(2, args.threads)
    try:
        from tfgpt.parallel.cpu_threads import configure_cpu_threads, resolve_towers
    except ImportError:  # a checkout from before towers (--tfgpt-path)
        towers = 1
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    else:
        # As the trainers choose: --towers 0 is TrainConfig's default.
        towers = resolve_towers(args.towers, args.threads, batches.shape[2], args.xla)
        configure_cpu_threads(args.threads, towers, inter_op_threads)
    import tfgpt
    from tfgpt import GPT
    from tfgpt.config import TrainConfig
    from tfgpt.observe import flops
    from tfgpt.optim.optimizers import make_optimizer
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.train_step import TrainStep

    keras.config.set_dtype_policy("mixed_bfloat16" if args.precision == "bf16" else "float32")
    keras.utils.set_random_seed(0)
    model = GPT.from_preset(args.preset, **json.loads(args.overrides))
    config = TrainConfig(data="-", warmup_steps=0, schedule="constant", learning_rate=1e-3)
    optimizer = make_optimizer(config)
    optimizer.build(model.trainable_variables)
    # `towers` only when used: a checkout from before towers has no such argument.
    step = TrainStep(model, optimizer, LocalDistribution(), xla=args.xla,
                     **({"towers": towers} if towers > 1 else {}))
    if args.recompute:
        from tfgpt.layers.transformer_block import set_recompute

        set_recompute(model, True)
    run_steps = _step_runner(step, [(tf.constant(x), tf.constant(y)) for x, y in batches])
    run_steps(args.warmup)
    _serve(run_steps, {
        "parameters": model.count_params(),
        "flops_per_token": flops.flops_per_token(model, batches.shape[-1]),
        "tfgpt": os.path.dirname(os.path.dirname(os.path.abspath(tfgpt.__file__))),
        "tensorflow": tf.__version__,
        "towers": towers,
    })


def _torch_worker(args, batches):
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(min(2, args.threads))
    sys.path.insert(0, REPO)
    from bench.torch_gpt import (
        TorchGPT,
        TorchTrainStep,
        flops_per_token,
        make_optimizer,
    )
    from tfgpt.config import GPTConfig

    torch.manual_seed(0)
    shape = GPTConfig.from_preset(args.preset, **json.loads(args.overrides))
    model = TorchGPT(**vars(shape))
    optimizer = make_optimizer(model)
    step = TorchTrainStep(model, optimizer, bfloat16=args.precision == "bf16", compile=args.compile)
    run_steps = _step_runner(
        step, [(torch.from_numpy(x).long(), torch.from_numpy(y).long()) for x, y in batches])
    run_steps(args.warmup)
    _serve(run_steps, {
        "parameters": sum(p.numel() for p in model.parameters()),
        "flops_per_token": flops_per_token(model, batches.shape[-1]),
        "torch": torch.__version__,
    })


def _peak_worker(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, args.threads))
    size, chain = 2048, 8
    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    a = tf.cast(tf.random.normal([size, size]) / size**0.5, dtype)

    @tf.function
    def matmuls(x):
        for _ in range(chain):
            x = tf.matmul(x, a)
        return x

    def run_steps(count):
        for _ in range(count):
            result = matmuls(a)
        return float(tf.reduce_sum(tf.cast(result[:1, :1], "float32")))

    run_steps(2)
    _serve(run_steps, {"flops_per_call": chain * 2 * size**3})


def worker_main(argv):
    from tfgpt.cli import HelpFormatter
    from tfgpt.config import GPT_PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput worker", formatter_class=HelpFormatter,
        description="One measured process: serves timed training steps of one configuration.",
    )
    parser.add_argument("--framework", choices=["tf", "torch", "peak"], required=True,
                        help="tfgpt, the PyTorch reference, or a matmul peak")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="float32, or mixed bfloat16")
    parser.add_argument("--xla", action="store_true", help="tfgpt: compile the step with XLA")
    parser.add_argument("--compile", action="store_true", help="PyTorch: torch.compile the model")
    parser.add_argument("--recompute", action="store_true", help="recompute the GPT blocks")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--inter-op-threads", type=int, default=0,
                        help="TensorFlow's inter-op threads; 0: min(2, --threads)")
    parser.add_argument("--towers", type=int, default=0,
                        help="TrainConfig.towers: slices of the batch run side by side; 0 chooses")
    parser.add_argument("--preset", default="gpt-mini", choices=list(GPT_PRESETS),
                        help="GPT preset")
    parser.add_argument("--overrides", default="{}", help="GPTConfig fields as JSON")
    parser.add_argument("--batches", help=".npy of (count, 2, batch, length) token ids")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--tfgpt-path", help="import tfgpt from this checkout instead")
    args = parser.parse_args(argv)
    if args.framework == "peak":
        return _peak_worker(args)
    import numpy as np

    batches = np.load(args.batches)
    if args.framework == "tf":
        return _tf_worker(args, batches)
    return _torch_worker(args, batches)


# ---- Driver -------------------------------------------------------------------


class Worker:
    """One configuration in its own process, started and warmed up at once."""

    def __init__(self, name, options, common, log_dir, env=None):
        import subprocess

        self.name = name
        argv = [sys.executable, "-m", "bench.throughput", "worker"]
        options = dict(options)
        env = {**(env or {}), **options.pop("env", {})}
        for key, value in {**common, **options}.items():
            if key == "tfgpt_path" and not value:
                continue
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not False and value is not None:
                argv += [flag, str(value)]
        environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {}))
        self.log_path = os.path.join(log_dir, name.replace(" ", "_").replace("@", "_") + ".log")
        self.process = subprocess.Popen(
            argv, cwd=REPO, env=environment, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"),
        )
        self.info = self._read()["ready"]

    def _read(self):
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            with open(self.log_path) as log:
                tail = log.read()[-3000:]
            raise RuntimeError(f"worker {self.name!r} exited ({self.process.returncode}):\n{tail}")
        return json.loads(line)

    def run(self, steps):
        self.process.stdin.write(f"run {steps}\n")
        self.process.stdin.flush()
        return self._read()

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            self.process.wait(timeout=60)


def make_batches(path, vocabulary_size, batch_size, length, count=4, seed=0):
    """Token batches made once with NumPy and fed to every framework."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocabulary_size, (count, batch_size, length + 1), dtype=np.int32)
    batches = np.stack([tokens[:, :, :-1], tokens[:, :, 1:]], axis=1)  # (count, 2, B, T)
    np.save(path, batches)
    return path


def _median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else 0.5 * (values[middle - 1] + values[middle])


def measure(names, preset, batch_size, rounds, steps_per_round, threads, out_dir,
            overrides=None, extra=None, log=print):
    """Runs the named configurations interleaved; returns per-configuration results.

    Args:
        names: keys of CONFIGURATIONS (or of `extra`).
        preset: GPT preset; `overrides` are GPTConfig fields on top.
        extra: more configurations {name: options}, e.g. another checkout.
    """
    from tfgpt.config import GPTConfig

    overrides = overrides or {}
    shape = GPTConfig.from_preset(preset, **overrides)
    length = shape.max_sequence_length
    os.makedirs(out_dir, exist_ok=True)
    batches = make_batches(os.path.join(out_dir, f"batches-{preset}.npy"),
                           shape.vocabulary_size, batch_size, length)
    common = dict(preset=preset, overrides=json.dumps(overrides), threads=threads, batches=batches)
    table = {**CONFIGURATIONS, **(extra or {})}
    workers = []
    try:
        for name in names:
            log(f"  starting {name} ...")
            start = time.perf_counter()
            workers.append(Worker(name, table[name], common, out_dir))
            log(f"  {name} ready in {time.perf_counter() - start:.0f} s")
        seconds = {name: [] for name in names}
        cpu_seconds = {name: [] for name in names}
        losses = {name: [] for name in names}
        for index in range(rounds):
            # Rotate the order so that no configuration always runs first.
            order = workers[index % len(workers):] + workers[:index % len(workers)]
            for worker in order:
                peak = worker.name.startswith("peak")
                result = worker.run(1 if peak else steps_per_round)
                seconds[worker.name].append(result["seconds"])
                cpu_seconds[worker.name].append(result["cpu_seconds"])
                losses[worker.name].append(result["loss"])
            log(f"  round {index + 1}/{rounds}: " + ", ".join(
                f"{w.name} {seconds[w.name][-1]:.2f}s" for w in workers))
    finally:
        for worker in workers:
            worker.close()
    results = {}
    tokens_per_step = batch_size * length
    for worker in workers:
        info = worker.info
        if worker.name.startswith("peak"):
            rates = [info["flops_per_call"] / s for s in seconds[worker.name]]
            results[worker.name] = {"flops_per_second": rates, "median": _median(rates), **info}
        else:
            rates = [tokens_per_step * steps_per_round / s for s in seconds[worker.name]]
            results[worker.name] = {
                "tokens_per_second": rates,
                "median": _median(rates),
                # Work per token, insensitive to other processes taking the
                # cores (but counting threads that spin while waiting).
                "tokens_per_cpu_second": _median(
                    [tokens_per_step * steps_per_round / s for s in cpu_seconds[worker.name]]),
                "sequences_per_second": _median(rates) / length,
                "last_loss": losses[worker.name][-1],
                **info,
            }
    return {
        "preset": preset, "overrides": overrides, "batch_size": batch_size,
        "sequence_length": length, "rounds": rounds, "steps_per_round": steps_per_round,
        "threads": threads, "results": results,
    }


def ratio(measurement, a, b):
    """Median over rounds of the per-round ratio a/b (same round, same load)."""
    results = measurement["results"]
    key = "tokens_per_second" if "tokens_per_second" in results[a] else "flops_per_second"
    pairs = zip(results[a][key], results[b][key])
    return _median([x / y for x, y in pairs])


def mfu(measurement, name, peak_name):
    """Model FLOPs / time against the peak, as a per-round median."""
    results = measurement["results"]
    per_round = [
        results[name]["flops_per_token"] * rate / peak
        for rate, peak in zip(results[name]["tokens_per_second"],
                              results[peak_name]["flops_per_second"])
    ]
    return _median(per_round)


def main(argv=None):
    from tfgpt.cli import HelpFormatter
    from tfgpt.config import GPT_PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--preset", default="gpt-mini", choices=list(GPT_PRESETS),
                        help="GPT preset to train")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; each times every configuration, alternating")
    parser.add_argument("--steps-per-round", type=int, default=3, metavar="N",
                        help="timed steps per configuration and round")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads of every process (intra-op threads, torch.set_num_threads)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGURATIONS),
                        choices=list(CONFIGURATIONS), metavar="CONFIG",
                        help="configurations to time (choices: "
                        + ", ".join(repr(name) for name in CONFIGURATIONS) + ")")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also run the tfgpt configurations from this checkout "
                        "(a directory, e.g. a `git worktree` of the commit before a change)")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results"), metavar="DIR",
                        help="directory for throughput-PRESET.json")
    args = parser.parse_args(argv)
    names = list(args.configs)
    extra = {}
    if args.baseline:
        for name in list(names):
            options = CONFIGURATIONS.get(name, {})
            if options.get("framework") == "tf":
                extra[name + " @baseline"] = {**options, "tfgpt_path": os.path.abspath(args.baseline)}
                names.append(name + " @baseline")
    # Token batches and worker logs go to a scratch directory, the figures beside it.
    measurement = measure(names, args.preset, args.batch_size, args.rounds, args.steps_per_round,
                          args.threads, os.path.join(args.out, "work", "throughput"), extra=extra)
    for name, result in measurement["results"].items():
        unit = "GFLOP/s" if name.startswith("peak") else "tokens/s"
        scale = 1e9 if name.startswith("peak") else 1
        print(f"{name:28s} {result['median'] / scale:10.1f} {unit}")
    for name in names:
        if name.endswith("@baseline"):
            print(f"{name[:-10]:28s} after/before = {ratio(measurement, name[:-10], name):.3f}")
    path = os.path.join(args.out, f"throughput-{args.preset}.json")
    with open(path, "w") as file:
        json.dump(measurement, file, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        main()
