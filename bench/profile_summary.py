"""Where the time of a profiled training step goes, from a TensorFlow trace.

Reads the `*.xplane.pb` that `tf.profiler.experimental` wrote (the trainers'
`--profile-steps START,END` write one under OUT/profile) and prints the
time per kind of operation, summed over every thread:

- graph mode (no XLA): TensorFlow kernels by op type (`_MklMatMul`,
  `StridedSliceGrad`, ...); the attention layers' own ops (between their
  two projections, forward and gradient) are listed apart with an
  `attention/` prefix;
- XLA: the compiled program's thunks by kind (`MatMul`, `dot`,
  `*_fusion`, ...), numbered suffixes removed.

The trace's own timestamps are used (no other timer), so the shares are
what the profiler saw; the absolute times include its overhead.

Usage:
    python -m bench.profile_summary runs/gpt/profile [--top 25]
"""

import argparse
import collections
import glob
import os
import re

# Ops of the attention layer between its two projections (scores, mask,
# softmax, the head layout), forward and gradient.
_ATTENTION_CORE = re.compile(r"/attention(_\d+)?/(?!query_key_value|output_projection)")


def load_space(directory):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {directory}")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as file:
        space.ParseFromString(file.read())
    return space, paths[-1]


def summarize(directory):
    """Returns {kind: seconds} over the host plane's compute threads."""
    space, _ = load_space(directory)
    totals = collections.Counter()
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        names = {key: value.name for key, value in plane.event_metadata.items()}
        for line in plane.lines:
            if line.name.startswith("tf_Compute"):
                for event in line.events:
                    name = names[event.metadata_id]
                    if name.startswith("ExecutorState"):  # the parent of every op event
                        continue
                    kind = name.rsplit(":", 1)[-1]
                    if _ATTENTION_CORE.search(name.split(":", 1)[0]):
                        kind = "attention/" + kind
                    totals[kind] += event.duration_ps
            elif "Eigen" in line.name:
                for event in line.events:
                    name = names[event.metadata_id]
                    # Executor and thread-pool frames enclose the thunks.
                    if name.startswith(("ThunkExecutor", "SlinkyThreadPool")):
                        continue
                    totals["xla:" + re.sub(r"([._]\d+)+$", "", name)] += event.duration_ps
    return {kind: picoseconds / 1e12 for kind, picoseconds in totals.items()}


def main(argv=None):
    from tfgpt.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python bench/profile_summary.py", description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "directory", metavar="DIR", help="a profile directory (a run's --profile output)"
    )
    parser.add_argument(
        "--top", type=int, default=25, metavar="N", help="operations to list, longest first"
    )
    args = parser.parse_args(argv)
    totals = summarize(args.directory)
    overall = sum(totals.values()) or 1.0
    print(f"{'seconds':>9} {'share':>6}  operation (summed over threads)")
    for kind, seconds in sorted(totals.items(), key=lambda item: -item[1])[:args.top]:
        print(f"{seconds:9.3f} {100 * seconds / overall:5.1f}%  {kind}")


if __name__ == "__main__":
    main()
