"""The command line of `pipelines.prepare`: flags, `--help`, exit statuses.

`python -m pipelines.prepare --help` shows the package docstring's usage
and inputs, then every flag with its choices and default. Parsing the
flags imports no TensorFlow; only the runs that need it (`--tfds`,
`--tokenizer-type wordpiece`) load it, when they start. Errors are one
line `error: ...` on stderr with exit status 2.
"""

import argparse
import re
import sys
from typing import Optional, Sequence

from pipelines.manifest import LEARN_CHOICES, RECORD_FORMATS, TOO_LONG_CHOICES
from pipelines.prepare.encoding import WorkerDied
from pipelines.prepare.run import (
    DEFAULT_SEED,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TOKENIZER_SAMPLE_BYTES,
    DEFAULT_VAL_FRACTION,
    MINIMUM_DEFAULT_CHUNK_SIZE,
    MINIMUM_SEQ_LEN,
    prepare,
)
from pipelines.prepare.tokenizer_training import TOKENIZER_TYPES
from pipelines.tokenizer import MINIMUM_VOCABULARY_SIZE
from pipelines.wordpiece_tokenizer import (
    MINIMUM_VOCABULARY_SIZE as MINIMUM_WORDPIECE_SIZE,
)
from tfgpt.cli import HelpFormatter

# `--compression` value -> the manifest's `compression`.
COMPRESSIONS = {"none": None, "gzip": "GZIP"}

_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_MULTIPLIERS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, argument_name: str = "size") -> int:
    """Parse a byte size such as `1048576`, `64K`, `10M`, `1G`, `1GiB` or `2gb`.

    Suffixes are binary (K = 1024 bytes). Used for `--shard-size`,
    `--chunk-size` and `--tokenizer-sample-bytes`.

    Args:
        text: str.
        argument_name: str. Named in the error message.

    Returns:
        int. The size in bytes, at least 1.
    """
    match = _SIZE_PATTERN.match(str(text))
    if match is None:
        raise ValueError(
            f"`{argument_name}` must be an integer with an optional K, M, G or T suffix "
            f"(binary units), e.g. 64K or 1G. Received: {argument_name}={text!r}"
        )
    size = int(match.group(1)) * _SIZE_MULTIPLIERS[match.group(2).lower()]
    if size < 1:
        raise ValueError(
            f"`{argument_name}` must be at least 1 byte. Received: {argument_name}={text!r}"
        )
    return size


def format_size(size: int) -> str:
    """The shortest text `parse_size` reads back as `size`, e.g. 1073741824 -> "1G"."""
    for suffix, multiplier in sorted(_SIZE_MULTIPLIERS.items(), key=lambda item: -item[1]):
        if size >= multiplier and size % multiplier == 0:
            return f"{size // multiplier}{suffix.upper()}"
    return str(size)


def _description() -> str:
    """The package docstring up to its steps: what the command does, examples, inputs."""
    import pipelines.prepare

    docstring = pipelines.prepare.__doc__ or ""
    return docstring.split("\nSteps")[0].strip()


def build_argument_parser() -> argparse.ArgumentParser:
    """The parser of `python -m pipelines.prepare`; flags are grouped by step."""
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.prepare",
        description=_description(),
        epilog=(
            "The steps, record formats, resuming and memory: python -m pydoc pipelines.prepare\n"
            "The manifest's keys: python -m pydoc pipelines.manifest"
        ),
        formatter_class=HelpFormatter,
    )
    # Flags whose default is "not given" (computed, or a choice between
    # inputs) state it in their help: argparse.SUPPRESS keeps "(default:
    # None)" off the help and the attribute off the namespace.
    not_given = argparse.SUPPRESS

    inputs = parser.add_argument_group("inputs")
    inputs.add_argument(
        "--input",
        action="append",
        dest="inputs",
        default=not_given,
        metavar="PATH_OR_GLOB",
        help="input file, glob or directory; repeat for several "
        "(default: Python's own documentation, without --input and --tfds)",
    )
    inputs.add_argument(
        "--tfds",
        action="append",
        default=not_given,
        metavar="NAME[:SPLIT]",
        help="a TensorFlow Datasets split (NAME alone: its train split) already prepared in "
        "--tfds-data-dir, read without downloading; repeat for several (default: none)",
    )
    inputs.add_argument(
        "--tfds-data-dir",
        default=not_given,
        metavar="DIR",
        help="the TensorFlow Datasets data_dir of --tfds (default: TFDS's own)",
    )
    inputs.add_argument(
        "--text-key",
        default="text",
        metavar="KEY",
        help="JSON Lines field / TFDS feature holding the text",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--output", required=True, default=not_given, metavar="DIR", help="output data directory"
    )
    output.add_argument(
        "--overwrite", action="store_true", help="replace a dataset already in --output"
    )
    output.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        required=True,
        default=not_given,
        help=f"the model's context length in tokens (at least {MINIMUM_SEQ_LEN}): packed "
        "records hold seq_len + 1 tokens, encoder records at most seq_len - 3",
    )
    output.add_argument(
        "--format",
        choices=tuple(RECORD_FORMATS),
        default="packed",
        help="records: packed, one token stream cut into records (GPT); encoder, a "
        "document's sentences grouped into records (BERT/ALBERT pretraining); instructions, "
        "one example per record, its completion or assistant turns learned (fine-tuning a "
        "GPT: "
        'JSON Lines of {"prompt", "completion"}, {"messages": [{"role", "content"}, ...]} or '
        '{"text"}, or the built-in corpus; needs --tokenizer)',
    )
    output.add_argument(
        "--too-long",
        choices=TOO_LONG_CHOICES,
        default="drop",
        help="--format instructions: an example longer than --seq-len + 1 tokens is dropped, "
        "or truncated (its end cut); the summary counts both",
    )
    output.add_argument(
        "--learn",
        choices=LEARN_CHOICES,
        default="completions",
        help="--format instructions: the tokens the loss is taken on: the completions and "
        "assistant turns (and the EOS after them), or all of every example",
    )
    output.add_argument(
        "--pack",
        action="store_true",
        help="--format instructions: pack examples best fit, several to a record of "
        "--seq-len + 1 tokens, each token's example recorded (segment_ids) so that "
        "training restarts positions and confines attention to it; the summary gives "
        "the fill",
    )
    output.add_argument(
        "--chat-template",
        metavar="PATH",
        help='--format instructions: the chat template of "messages" examples: a Jinja file, '
        "or a Hugging Face model directory or its tokenizer_config.json (default: the "
        "--tokenizer directory's, else ChatML's turns)",
    )
    output.add_argument(
        "--shard-size",
        default=format_size(DEFAULT_SHARD_SIZE),
        metavar="SIZE",
        help="a shard is closed before it passes this many uncompressed bytes "
        "(binary units: 64K, 10M, 1G)",
    )
    output.add_argument(
        "--compression",
        choices=tuple(COMPRESSIONS),
        default="none",
        help="shard compression (gzip output is still byte-identical across runs)",
    )
    output.add_argument(
        "--val-fraction",
        type=float,
        metavar="FRACTION",
        default=DEFAULT_VAL_FRACTION,
        help="share of the corpus's bytes, by whole documents, for the validation split; "
        "0 writes none",
    )
    output.add_argument(
        "--seed",
        type=int,
        metavar="N",
        default=DEFAULT_SEED,
        help="keys the document hash that decides the split and the tokenizer's sample",
    )

    tokenizer = parser.add_argument_group("tokenizer")
    tokenizer.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default="bpe",
        help="the tokenizer to train: SentencePiece bpe or unigram, or WordPiece "
        "(wordpiece imports TensorFlow)",
    )
    tokenizer.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        default=not_given,
        help=f"vocabulary size to train: at least {MINIMUM_VOCABULARY_SIZE} "
        f"({MINIMUM_VOCABULARY_SIZE + 3} with --format encoder) for bpe and unigram, an "
        f"upper bound of at least {MINIMUM_WORDPIECE_SIZE} for wordpiece "
        "(required unless --tokenizer)",
    )
    tokenizer.add_argument(
        "--tokenizer",
        default=not_given,
        metavar="PATH",
        help="reuse a tokenizer: tokenizer.model, vocab.txt, a Hugging Face byte-level BPE "
        "tokenizer.json, or a directory holding one, e.g. an earlier data directory or a "
        "Hugging Face model's (default: train one on the corpus)",
    )
    tokenizer.add_argument(
        "--tokenizer-sample-bytes",
        default=format_size(DEFAULT_TOKENIZER_SAMPLE_BYTES),
        metavar="SIZE",
        help="cap on the training documents' bytes the tokenizer is trained on",
    )

    parallelism = parser.add_argument_group("parallelism")
    parallelism.add_argument(
        "--workers",
        type=int,
        metavar="N",
        default=not_given,
        help="processes that read, encode and write chunks in parallel (default: one per core)",
    )
    parallelism.add_argument(
        "--num-threads",
        type=int,
        metavar="N",
        default=not_given,
        help="SentencePiece threads per worker (default: cores / workers)",
    )
    parallelism.add_argument(
        "--chunk-size",
        default=not_given,
        metavar="SIZE",
        help="input bytes per unit of parallel work and of resuming "
        f"(default: twice --shard-size, at least {format_size(MINIMUM_DEFAULT_CHUNK_SIZE)})",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point. Returns the exit status (0, or 2 on bad input).

    Args:
        argv: sequence of str or None. Arguments without the program name;
            None reads `sys.argv[1:]`.
    """
    arguments = vars(build_argument_parser().parse_args(argv))
    chunk_size = arguments.get("chunk_size")
    try:
        prepare(
            arguments["output"],
            arguments.get("inputs"),
            seq_len=arguments["seq_len"],
            vocabulary_size=arguments.get("vocab_size"),
            tokenizer_path=arguments.get("tokenizer"),
            tokenizer_type=arguments["tokenizer_type"],
            shard_size=parse_size(arguments["shard_size"], "shard_size"),
            chunk_size=None if chunk_size is None else parse_size(chunk_size, "chunk_size"),
            val_fraction=arguments["val_fraction"],
            seed=arguments["seed"],
            tokenizer_sample_bytes=parse_size(
                arguments["tokenizer_sample_bytes"], "tokenizer_sample_bytes"
            ),
            overwrite=arguments["overwrite"],
            num_threads=arguments.get("num_threads"),
            workers=arguments.get("workers"),
            record_format=arguments["format"],
            compression=COMPRESSIONS[arguments["compression"]],
            tfds=arguments.get("tfds", ()),
            tfds_data_dir=arguments.get("tfds_data_dir"),
            text_key=arguments["text_key"],
            too_long=arguments["too_long"],
            learn=arguments["learn"],
            chat_template=arguments.get("chat_template"),
            pack=arguments["pack"],
            interactive_progress=sys.stderr.isatty(),
        )
    except (ValueError, OSError, WorkerDied) as error:
        message = (
            str(error)
            if not isinstance(error, OSError)
            else (f"{error.filename}: {error.strerror}" if error.filename else str(error))
        )
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0
