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

With `--chat`, each prompt is a user's turn of a conversation (after
`--system`, and after the turns of `--messages FILE`, a JSON list of
`{"role", "content"}`), rendered with the model's chat template (the one
its instruction data was prepared with, a Hugging Face directory's, else
ChatML's turns: `pipelines.chat_template`); only the reply is printed, cut
at the template's end-of-turn marker:

    python -m tfgpt.generate --checkpoint runs/sft --chat --system "Be brief." \
        --prompt "What does len() return?"
"""

import argparse
import json
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
        "--prompt", action="append", metavar="TEXT",
        help="text to continue (with --chat: a user's turn); repeat the flag to generate for "
        "several prompts in one batch (required unless --chat --messages)",
    )
    parser.add_argument(
        "--chat", action="store_true",
        help="render each prompt as a conversation with the model's chat template and print "
        "the reply alone",
    )
    parser.add_argument(
        "--system", metavar="TEXT",
        help="with --chat: a system turn before the conversation",
    )
    parser.add_argument(
        "--messages", metavar="FILE",
        help='with --chat: a JSON list of {"role", "content"} turns: the conversation so far, '
        "which the prompt (if any) continues",
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
    args = parser.parse_args(argv)
    if not args.chat and (args.system is not None or args.messages is not None):
        parser.error("--system and --messages are for --chat")
    if not args.prompt and not (args.chat and args.messages):
        parser.error("--prompt is required (or --chat --messages FILE)")
    return args


def conversations(args):
    """`--chat`'s conversations, one per prompt (one without a prompt): the
    system turn, `--messages`'s turns, then the prompt as a user's turn."""
    from pipelines.chat_template import ROLES

    history = []
    if args.system is not None:
        history.append({"role": "system", "content": args.system})
    if args.messages is not None:
        with open(args.messages, encoding="utf-8") as file:
            try:
                turns = json.load(file)
            except json.JSONDecodeError as error:
                raise ValueError(f"--messages {args.messages}: not JSON ({error})") from None
        if not isinstance(turns, list) or not all(
                isinstance(turn, dict) and turn.get("role") in ROLES
                and isinstance(turn.get("content"), str) for turn in turns):
            raise ValueError(f"--messages {args.messages}: expected a JSON list of "
                             f'{{"role", "content"}} with roles {", ".join(ROLES)}')
        history += turns
    return [history + [{"role": "user", "content": prompt}] for prompt in args.prompt or []] or [
        history]


def chat_prompts(args, tokenizer, template):
    """The ids of each `conversations` rendered with `template`, ready for
    the reply; a template's leading BOS text is left to a tokenizer that
    puts the BOS id first itself."""
    prompts = []
    for messages in conversations(args):
        text = template.render(messages, add_generation_prompt=True)
        bos = template.special_tokens.get("bos_token")
        if bos and text.startswith(bos) and tokenizer.encode(""):
            text = text[len(bos):]
        prompts.append(tokenizer.encode(text))
    return prompts


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
    template = None
    if args.chat:
        from pipelines.chat_template import chat_template_of

        template = chat_template_of(args.checkpoint)
    prompts = chat_prompts(args, tokenizer, template) if template else []
    for text in [] if template else args.prompt:
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
        if template is None:
            print(tokenizer.decode(prompt + continuation))
            continue
        reply, end = tokenizer.decode(continuation), template.end_of_turn()
        print(reply[:reply.index(end)] if end and end in reply else reply)
    count = sum(len(row) for row in new_ids)
    print(
        f"[generate] {count} new tokens for {len(prompts)} prompt(s) in {elapsed:.2f} s: "
        f"{count / elapsed:.1f} tokens/s ({'no cache' if args.no_cache else 'KV cache'}"
        f"{', XLA' if args.xla else ''}; tracing and warm-up took {warmup:.2f} s before)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
