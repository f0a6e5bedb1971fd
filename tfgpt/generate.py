"""Sample text from a checkpoint: `python -m tfgpt.generate`.

Usage:
    python -m tfgpt.generate --checkpoint runs/demo --prompt "The built-in function" \\
        --max-new-tokens 60 --temperature 0.8 --top-k 40 --seed 1

`--checkpoint` is a tfgpt run directory (the trainer's, or one written by
`python -m tfgpt.convert to-tfgpt`) or a Hugging Face GPT-2 directory.
`--prompt` may be repeated to generate for several prompts in one batch.
The text (prompt and continuation) goes to stdout; timings and tokens/s go
to stderr. Generation stops at the tokenizer's end-of-text id unless
`--ignore-eos` is given. Greedy unless `--temperature` is above 0.
"""

import argparse
import sys
import time

from tfgpt.cli import HelpFormatter


def add_sampling_flags(parser):
    """`--temperature`, `--top-k` and `--top-p`: the sampling flags of
    `python -m tfgpt.generate` and `python -m tfgpt.export`."""
    parser.add_argument(
        "--temperature", type=float, default=0.0, metavar="T",
        help="sampling temperature; 0 picks the most likely token (greedy)",
    )
    parser.add_argument(
        "--top-k", type=int, default=0, metavar="K",
        help="sample among the K most likely tokens only; 0 is off",
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, metavar="P",
        help="sample among the most likely tokens whose probabilities sum to P "
        "(nucleus sampling); 1 is off",
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tfgpt.generate", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR",
        help="a tfgpt run directory or a Hugging Face GPT-2 directory",
    )
    parser.add_argument(
        "--prompt", action="append", required=True, metavar="TEXT",
        help="text to continue; repeat the flag to generate for several prompts in one batch",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=50, metavar="N",
        help="tokens to generate after each prompt",
    )
    add_sampling_flags(parser)
    parser.add_argument(
        "--seed", type=int, default=None,
        help="random seed of the sampling, for a repeatable run; unset: a fresh one",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="keep generating past the tokenizer's end-of-text id",
    )
    parser.add_argument(
        "--no-cache", action="store_true",
        help="recompute the whole prefix for every new token instead of reading the "
        "KV cache (slower; a check of the cached path)",
    )
    parser.add_argument(
        "--xla", action="store_true", help="compile the decode loop with XLA",
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # Imported after the flags are parsed: `--help` starts no TensorFlow.
    from tfgpt.loading import load_model

    model, tokenizer = load_model(args.checkpoint)
    if tokenizer is None:
        raise ValueError(
            f"No tokenizer in {args.checkpoint}: expected tokenizer.model or "
            "vocab.json and merges.txt"
        )
    eos_id = tokenizer.eos_id if tokenizer.eos_id is not None and tokenizer.eos_id >= 0 else None
    prompts = []
    for text in args.prompt:
        ids = tokenizer.encode(text)
        if not ids:
            if eos_id is None:
                raise ValueError(
                    "The prompt is empty and the tokenizer has no end-of-text id to "
                    f"start from. Received: prompt={text!r}"
                )
            ids = [eos_id]  # a document start, as after EOS in the training stream
        prompts.append(ids)
    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=None if args.ignore_eos or eos_id is None else [eos_id],
        use_cache=not args.no_cache,
        jit_compile=args.xla,
    )
    # Trace on a two-token run first, so that the rate below is the decode
    # loop's, not the tracer's. XLA compiles per shape: its warm-up is the
    # full run.
    start = time.perf_counter()
    warmup_tokens = args.max_new_tokens if args.xla else min(2, args.max_new_tokens)
    model.generate(prompts, warmup_tokens, **options)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    new_ids = model.generate(prompts, args.max_new_tokens, **options)
    elapsed = time.perf_counter() - start

    for index, (prompt, continuation) in enumerate(zip(prompts, new_ids)):
        if index:
            print("-" * 40)
        print(tokenizer.decode(prompt + continuation))
    count = sum(len(row) for row in new_ids)
    print(
        f"[generate] {count} new tokens for {len(prompts)} prompt(s) in {elapsed:.2f} s: "
        f"{count / elapsed:.1f} tokens/s ({'no cache' if args.no_cache else 'KV cache'}"
        f"{', XLA' if args.xla else ''}; tracing and warm-up took {warmup:.2f} s before)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
