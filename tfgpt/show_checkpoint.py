"""What a checkpoint holds, from its index: `tfgpt checkpoint PATH`.

    tfgpt checkpoint runs/demo                  # the run's newest complete checkpoint
    tfgpt checkpoint runs/demo/ckpt-200 --keys  # every tensor: shape, dtype, chunks
    tfgpt checkpoint runs/demo --verify         # and read every chunk back

Prints the step, the layout that wrote it (ranks = data x pipeline x
tensor), the model's parameters and the optimizer's state in tensors and
bytes, the files, and for a run directory its other checkpoints and any
save that did not finish. Reads `index.json` alone, without TensorFlow;
`--verify` reads every chunk file back and joins each tensor whole (the
stamps of the files, the rows and slices covering each tensor, the
shapes), as resuming on another layout would. Exits 2 with one line for a
path that is not a checkpoint, or a checkpoint that does not read whole.
(The format: `tfgpt.checkpoint.files`, which imports TensorFlow.)
"""

import argparse
import json
import os
import re
import sys

from tfgpt.cli import HelpFormatter, byte_size

INDEX_FILE = "index.json"  # tfgpt.checkpoint.files.INDEX_FILE, which imports TensorFlow
_STEP = re.compile(r"^ckpt-(\d+)$")
# Bytes per element of the dtypes a checkpoint stores that NumPy does not name.
_ITEM_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8,
               "uint8": 1, "uint32": 4, "uint64": 8, "bool": 1, "string": 1}


def _steps(run_dir):
    """`{step: complete}` of the `ckpt-S` directories in `run_dir` (complete: with an index)."""
    named = [(int(match.group(1)), os.path.join(run_dir, match.group(0)))
             for match in map(_STEP.match, os.listdir(run_dir)) if match]
    return {step: os.path.exists(os.path.join(path, INDEX_FILE))
            for step, path in named if os.path.isdir(path)}


def resolve(path):
    """`(checkpoint directory, run directory or None)` of `path`: a checkpoint, or a run
    directory's newest complete one. ValueError in one line otherwise."""
    if os.path.exists(os.path.join(path, INDEX_FILE)):
        return path, None
    if not os.path.isdir(path):
        raise ValueError(f"{path} does not exist")
    steps = _steps(path)
    complete = [step for step, done in steps.items() if done]
    if not complete:
        what = (f"its {len(steps)} ckpt-S director(ies) have no {INDEX_FILE}: their saves did "
                "not finish" if steps else "no checkpoint (ckpt-S/index.json) in it")
        raise ValueError(f"{path}: {what}")
    return os.path.join(path, f"ckpt-{max(complete)}"), path


def kind(key, entry):
    """What the tensor `key` (its index `entry`) is: "model", "optimizer", "run" (the
    step, the data position) or "per rank" (a dropout generator's state, saved by
    each rank as its own); `tfgpt.checkpoint.state` names them."""
    if key in ("step", "data_cursor"):
        return "run"
    if all(chunk.get("rank") is not None for chunk in entry["chunks"]):
        return "per rank"
    if key.startswith("optimizer/") or key.rsplit("/", 1)[-1] in ("momentum", "velocity"):
        return "optimizer"
    return "model"


def summary(checkpoint, run_dir=None, keys=False):
    """The lines `tfgpt checkpoint` prints for the checkpoint directory `checkpoint`."""
    with open(os.path.join(checkpoint, INDEX_FILE)) as file:
        index = json.load(file)
    layout = index.get("layout", {})
    ranks = layout.get("ranks", len(index.get("files", {})))
    data, pipeline, tensor = layout.get("data_pipeline_tensor", (ranks, 1, 1))
    lines = [f"{checkpoint}: step {index.get('step')}, written by {ranks} rank(s) = data {data} "
             f"x pipeline {pipeline} x tensor {tensor} (format {index.get('format')})"]
    totals = {}
    for key, entry in index["keys"].items():
        elements = 1
        for size in entry["shape"]:
            elements *= size
        count, numbers, size = totals.get(kind(key, entry), (0, 0, 0))
        totals[kind(key, entry)] = (count + 1, numbers + elements,
                             size + elements * _ITEM_SIZES.get(entry["dtype"], 4))
    for name in ("model", "optimizer", "run", "per rank"):
        if name in totals:
            count, numbers, size = totals[name]
            what = "parameters" if name == "model" else "numbers"
            lines.append(f"{name}: {numbers:,} {what} in {count} tensor(s), {byte_size(size)}")
    files = sorted(index.get("files", {}))
    on_disk = sum(os.path.getsize(os.path.join(checkpoint, name)) for name in os.listdir(checkpoint)
                  if os.path.isfile(os.path.join(checkpoint, name)))
    lines.append(f"files: {len(files)} chunk file(s) ({', '.join(files[:3])}"
                 f"{', ...' if len(files) > 3 else ''}), {byte_size(on_disk)} on disk")
    if run_dir is not None:
        steps = _steps(run_dir)
        others = [f"ckpt-{step}" for step, done in sorted(steps.items())
                  if done and os.path.join(run_dir, f"ckpt-{step}") != checkpoint]
        unfinished = [f"ckpt-{step}" for step, done in sorted(steps.items()) if not done]
        lines.append(f"other checkpoints: {', '.join(others) or 'none'}")
        if unfinished:
            lines.append(f"saves that did not finish (no {INDEX_FILE}; resuming skips them): "
                         f"{', '.join(unfinished)}")
    if keys:
        for key in sorted(index["keys"]):
            entry = index["keys"][key]
            lines.append(f"  {key}  {tuple(entry['shape'])} {entry['dtype']}, "
                         f"{len(entry['chunks'])} chunk(s) [{kind(key, entry)}]")
    return lines


def verify(checkpoint):
    """Reads every tensor of `checkpoint` whole (`tfgpt.checkpoint.files.Reader`): the
    number of tensors read. ValueError in one line for anything that does not read."""
    from tfgpt.checkpoint.files import Reader  # imports TensorFlow

    reader = Reader(checkpoint)
    try:
        for key, entry in sorted(reader.keys.items()):
            if kind(key, entry) != "per rank":
                reader.whole(key)
            else:
                for chunk in entry["chunks"]:
                    reader.array(chunk, entry["dtype"])
        return len(reader.keys)
    finally:
        reader.close()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfgpt checkpoint", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("path", metavar="PATH",
                        help="a checkpoint (RUN/ckpt-S) or a run directory (its newest)")
    parser.add_argument("--keys", action="store_true",
                        help="list every tensor with its shape, dtype and chunk count")
    parser.add_argument("--verify", action="store_true",
                        help="read every chunk back and join each tensor whole")
    args = parser.parse_args(argv)
    try:
        checkpoint, run_dir = resolve(args.path)
        print("\n".join(summary(checkpoint, run_dir, keys=args.keys)))
        if args.verify:
            print(f"verified: every one of the {verify(checkpoint)} tensor(s) reads whole")
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
