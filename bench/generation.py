"""Generation throughput with and without the key/value cache (not a test).

Usage:
    python bench/generation.py --xla                 # gpt-mini, 32/256/1024 new tokens
    python bench/generation.py --new-tokens 32 256 --batch-size 4 --rounds 5

Builds the preset with random weights (the speed of a forward pass does not
depend on their values) and greedy-decodes `--new-tokens` tokens after a
`--prompt-length` prompt with no stop token: with the cache, without it
(the whole prefix recomputed for every token) and, with `--xla`, with the
cached loop compiled by XLA. The variants run interleaved, one call each
per round, after an untimed warm-up (tracing; XLA's compilation); the table
gives median tokens/s and the median per-round speed-up of the cache, on
wall time and on this process's CPU time (on a shared machine other jobs
stretch the wall clock, not the CPU work of a run; the load average is
printed beside each row). gpt-mini's context is 256 positions; it is
widened with `--max-sequence-length` (default: just enough for the longest
run) so that 1024 new tokens fit; only the position table grows.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfgpt.cli import HelpFormatter  # noqa: E402
from tfgpt.config import GPT_PRESETS  # noqa: E402


def run_once(model, prompts, new_tokens, **options):
    """Returns (wall seconds, CPU seconds of this process) of one generate call."""
    wall, cpu = time.perf_counter(), time.process_time()
    output = model.generate(prompts, new_tokens, **options)
    assert all(len(row) == new_tokens for row in output)
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(
        prog="python bench/generation.py", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--preset", default="gpt-mini", choices=list(GPT_PRESETS),
        help="GPT preset to time (randomly initialised)",
    )
    parser.add_argument(
        "--new-tokens", type=int, nargs="+", default=[32, 256, 1024], metavar="N",
        help="generation lengths to time, one row each",
    )
    parser.add_argument(
        "--prompt-length", type=int, default=8, metavar="T", help="prompt tokens per row"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="prompts generated at once")
    parser.add_argument(
        "--max-sequence-length", type=int, default=None, metavar="T",
        help="the model's context; unset: the longest run needs, at least 256",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per length")
    parser.add_argument(
        "--long-rounds", type=int, default=1, help="rounds from --long-from new tokens on"
    )
    parser.add_argument(
        "--long-from", type=int, default=1024, metavar="N",
        help="lengths from this one on are long: timed --long-rounds times",
    )
    parser.add_argument("--xla", action="store_true", help="also time the XLA-compiled loop")
    parser.add_argument("--json", metavar="FILE", help="also write the results to this file")
    args = parser.parse_args()

    # Imported after the flags are parsed: `--help` starts no TensorFlow.
    import numpy as np

    from tfgpt import GPT

    context = args.max_sequence_length or max(256, args.prompt_length + max(args.new_tokens))
    model = GPT.from_preset(args.preset, max_sequence_length=context)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.vocabulary_size, (args.batch_size, args.prompt_length)).tolist()
    print(
        f"{args.preset} ({model.count_params():,} parameters, context {context}), "
        f"batch {args.batch_size}, prompt {args.prompt_length} tokens, greedy, "
        f"{os.cpu_count()} CPU cores",
        flush=True,
    )
    runs = {"cached": dict(), "uncached": dict(use_cache=False)}
    if args.xla:
        runs["cached_xla"] = dict(jit_compile=True)
    header = f"{'new tokens':>10} | " + " | ".join(f"{name + ' tok/s':>16}" for name in runs)
    header += f" | {'speed-up (wall)':>15} | {'speed-up (CPU)':>14}"
    print(header)
    print("-" * len(header), flush=True)
    results = []
    for new_tokens in args.new_tokens:
        row = {"new_tokens": new_tokens, "load_average_before": os.getloadavg()[0]}
        # Warm up: the graph-mode loop is traced once for every shape, so two
        # tokens do; XLA compiles per shape and warms up on the real size.
        for options in runs.values():
            model.generate(prompts, new_tokens if options.get("jit_compile") else 2, **options)
        rounds = args.rounds if new_tokens < args.long_from else args.long_rounds
        times = {name: [] for name in runs}
        for _ in range(rounds):
            # Interleaved: a slow spell of the machine hits every variant of a round.
            for name, options in runs.items():
                times[name].append(run_once(model, prompts, new_tokens, **options))
        tokens = len(prompts) * new_tokens
        for name in runs:
            row[name] = tokens / statistics.median(wall for wall, _ in times[name])
            row[name + "_per_cpu_second"] = tokens / statistics.median(cpu for _, cpu in times[name])
        for kind, index in (("wall", 0), ("cpu", 1)):
            row["speedup_" + kind] = statistics.median(
                uncached[index] / cached[index]
                for cached, uncached in zip(times["cached"], times["uncached"])
            )
        row["rounds"] = rounds
        row["load_average_after"] = os.getloadavg()[0]
        print(
            f"{new_tokens:>10} | " + " | ".join(f"{row[name]:>16.1f}" for name in runs)
            + f" | {row['speedup_wall']:>14.1f}x | {row['speedup_cpu']:>13.1f}x"
            + f"   ({rounds} round(s), load {row['load_average_before']:.1f}"
            + f" -> {row['load_average_after']:.1f})",
            flush=True,
        )
        results.append(row)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "results": results}, file, indent=2)


if __name__ == "__main__":
    main()
