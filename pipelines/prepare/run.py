"""`prepare()`: the steps of `pipelines.prepare` in order, from the inputs to a data directory.

Validate the arguments, plan the chunks, lock the output directory, then
scan, train (or load) the tokenizer, encode and write, and commit, or take
the scan and the tokenizer from an interrupted run and encode only the
chunks it did not finish. The steps live in their own modules; this one
decides what a run is (`settings`: a rerun resumes only if they match).
"""

import hashlib
import os
import time
from typing import Callable, Optional, Sequence

from pipelines.chat_template import TEMPLATE_FILE, chat_template_of, load_chat_template
from pipelines.errors import DataError
from pipelines.files import write_atomically
from pipelines.manifest import (
    COMPRESSIONS,
    LEARN_CHOICES,
    MANIFEST_FILENAME,
    RECORD_FORMATS,
    SPLITS,
    TOO_LONG_CHOICES,
    Manifest,
)
from pipelines.prepare import resume, tokenizer_training
from pipelines.prepare.commit import build_manifest, commit, split_summary
from pipelines.prepare.encoding import ChunkRunner, WorkerDied, encode_chunks
from pipelines.prepare.progress import Progress, stderr_log
from pipelines.prepare.scan import scan_chunks
from pipelines.prepare.tokenizer_training import TOKENIZER_TYPES
from pipelines.sources import (
    Source,
    describe_chunk,
    fingerprint,
    make_sources,
    plan_chunks,
    resolve_inputs,
)
from pipelines.tokenizer import NUMBER_OF_BYTE_PIECES, minimum_vocabulary_size
from pipelines.wordpiece_tokenizer import (
    check_vocabulary_size as check_wordpiece_vocabulary_size,
)

MINIMUM_SEQ_LEN = 8
DEFAULT_SHARD_SIZE = 1 << 30  # 1 GiB, as in the reference design.
MINIMUM_DEFAULT_CHUNK_SIZE = 64 << 20
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SEED = 0
# 64 MiB of text is plenty for vocabularies up to ~50k pieces, and SentencePiece
# needs roughly 10-20x the sample size in memory while training.
DEFAULT_TOKENIZER_SAMPLE_BYTES = 64 << 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _chat_template(path, tokenizer_path):
    """The `ChatTemplate` of instruction data: `path`'s (which must hold
    one), else the tokenizer directory's, else tfgpt's default."""
    if path is not None:
        template = load_chat_template(path)
        if template is None:
            raise ValueError(f"--chat-template {path}: no chat template there (expected a Jinja "
                             f"file, {TEMPLATE_FILE}, or a tokenizer_config.json with one)")
        return template
    directory = (tokenizer_path if tokenizer_path and os.path.isdir(tokenizer_path)
                 else os.path.dirname(tokenizer_path or ""))
    return chat_template_of(directory or None)


def _check_byte_count(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive number of bytes. Received: {name}={value!r}"
        )


def _check_vocabulary_size(vocabulary_size, tokenizer_type, record_format) -> None:
    """Raise ValueError if a vocabulary to train cannot hold the tokenizer's fixed pieces."""
    if vocabulary_size is None:
        return
    if tokenizer_type == "wordpiece":
        check_wordpiece_vocabulary_size(vocabulary_size)
        return
    encoder = record_format == "encoder"
    minimum = minimum_vocabulary_size(encoder_special_tokens=encoder)
    if not _is_int(vocabulary_size) or vocabulary_size < minimum:
        specials = minimum - NUMBER_OF_BYTE_PIECES - 1
        raise ValueError(
            f"`vocabulary_size` must be an int of at least {minimum}"
            + (" for --format encoder" if encoder else "")
            + f" ({specials} special + {NUMBER_OF_BYTE_PIECES} byte-fallback pieces + 1). "
            f"Received: vocabulary_size={vocabulary_size!r}"
        )


def prepare(
    output_directory: str,
    inputs: Optional[Sequence[str]] = None,
    *,
    seq_len: int,
    vocabulary_size: Optional[int] = None,
    tokenizer_path: Optional[str] = None,
    tokenizer_type: str = "bpe",
    shard_size: int = DEFAULT_SHARD_SIZE,
    chunk_size: Optional[int] = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = DEFAULT_SEED,
    tokenizer_sample_bytes: int = DEFAULT_TOKENIZER_SAMPLE_BYTES,
    overwrite: bool = False,
    num_threads: Optional[int] = None,
    workers: Optional[int] = None,
    record_format: str = "packed",
    compression: Optional[str] = None,
    tfds: Sequence[str] = (),
    tfds_data_dir: Optional[str] = None,
    text_key: str = "text",
    too_long: str = "drop",
    learn: str = "completions",
    chat_template: Optional[str] = None,
    pack: bool = False,
    log: Callable[[str], None] = stderr_log,
    interactive_progress: bool = False,
) -> Manifest:
    """Build a tfgpt data directory from raw text. The CLI calls this.

    Args:
        output_directory: str. Created if missing. Must not already hold
            shards or a manifest unless `overwrite=True`.
        inputs: sequence of str or None. Files, globs or directories (see
            `pipelines.sources`); None (and no `tfds`) uses
            `pipelines.default_corpus`.
        seq_len: int. Model context length, at least `MINIMUM_SEQ_LEN` (8).
            Packed records hold `seq_len + 1` tokens; encoder examples are
            `seq_len` tokens including [CLS] and two [SEP].
        vocabulary_size: int or None. Size of the tokenizer to train (an
            upper bound for WordPiece). Required unless `tokenizer_path` is
            given (then it must match, if given).
        tokenizer_path: str or None. An existing tokenizer to reuse: a
            SentencePiece model, a WordPiece `vocab.txt`, a Hugging Face
            byte-level BPE `tokenizer.json`, or a directory with one (e.g. an
            earlier data directory, or a Hugging Face model's).
        tokenizer_type: str. "bpe", "unigram" (SentencePiece) or "wordpiece".
        shard_size: int. Target shard size in bytes (default 1 GiB).
        chunk_size: int or None. Bytes of input per unit of work (default
            `max(2 * shard_size, 64 MiB)`).
        val_fraction: float. Share of the corpus's bytes, in [0, 1), that goes
            to the validation split, by whole documents. 0 writes no val split.
        seed: int. Keys the document hash that decides splits and the
            tokenizer sample.
        tokenizer_sample_bytes: int. Cap on the training documents' bytes
            used to train the tokenizer (default 64 MiB).
        overwrite: bool. Replace an existing dataset in `output_directory`.
        num_threads: int or None. SentencePiece threads per worker; None uses
            the cores not taken by other workers.
        workers: int or None. Processes; None uses every core.
        record_format: str. "packed" (GPT), "encoder" (BERT/ALBERT) or
            "instructions" (fine-tuning a GPT on prompts and completions,
            from JSON Lines or the built-in corpus; needs `tokenizer_path`,
            the model's tokenizer).
        compression: None or "GZIP".
        tfds: sequence of str. TensorFlow Datasets splits, `NAME[:SPLIT]`.
        tfds_data_dir: str or None. Their (already prepared) data directory.
        text_key: str. JSON / TFDS feature holding the text (not read for
            instructions).
        too_long: str. Instructions: an example longer than `seq_len + 1`
            tokens is "drop"ped or "truncate"d (its end cut); each counted
            in the summary.
        learn: str. Instructions: "completions" learns only completions
            and assistant turns; "all", every token of every example.
        chat_template: str or None. Instructions: where the chat template
            of "messages" examples comes from (a Jinja file, or a Hugging
            Face directory or its `tokenizer_config.json`); None: the
            tokenizer's directory's, else tfgpt's default
            (`pipelines.chat_template`).
        pack: bool. Instructions: pack each chunk's examples best fit into
            records of at most `seq_len + 1` tokens, each token's example
            in `segment_ids` (`pipelines.manifest`), instead of one to a
            record; the summary gives the records' fill.
        log: callable taking a str. Progress sink (stderr by default).
        interactive_progress: bool. Redraw the progress line in place.

    Returns:
        dict. The manifest, as written to `manifest.json`.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"`tokenizer_type` must be one of {TOKENIZER_TYPES}. "
            f"Received: tokenizer_type={tokenizer_type!r}"
        )
    if not _is_int(seq_len) or seq_len < MINIMUM_SEQ_LEN:
        raise ValueError(
            f"`seq_len` must be an int of at least {MINIMUM_SEQ_LEN}. "
            f"Received: seq_len={seq_len!r}"
        )
    _check_vocabulary_size(vocabulary_size, tokenizer_type, record_format)
    _check_byte_count("shard_size", shard_size)
    if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"`val_fraction` must be in [0, 1). Received: val_fraction={val_fraction!r}"
        )
    if not _is_int(seed) or not 0 <= seed < (1 << 63):
        raise ValueError(f"`seed` must be an int in [0, 2**63). Received: seed={seed!r}")
    _check_byte_count("tokenizer_sample_bytes", tokenizer_sample_bytes)
    if record_format not in RECORD_FORMATS:
        raise ValueError(
            f"`record_format` must be one of {tuple(RECORD_FORMATS)}. "
            f"Received: record_format={record_format!r}"
        )
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"`compression` must be None or 'GZIP'. Received: compression={compression!r}"
        )
    encoder = record_format == "encoder"
    instructions = record_format == "instructions"
    if too_long not in TOO_LONG_CHOICES:
        raise ValueError(f"`too_long` must be one of {TOO_LONG_CHOICES}. "
                         f"Received: too_long={too_long!r}")
    if learn not in LEARN_CHOICES:
        raise ValueError(f"`learn` must be one of {LEARN_CHOICES}. Received: learn={learn!r}")
    if pack and not instructions:
        raise ValueError("`pack` packs instruction examples: it needs --format instructions. "
                         f"Received: pack=True, record_format={record_format!r}")
    chat = _chat_template(chat_template, tokenizer_path) if instructions else None
    if instructions and tokenizer_path is None:
        raise ValueError(
            "--format instructions needs --tokenizer, the tokenizer of the model to fine-tune "
            "(e.g. its run, data or Hugging Face directory): a tokenizer trained on the "
            "examples would not match the model's ids")
    if chunk_size is None:
        chunk_size = max(2 * shard_size, MINIMUM_DEFAULT_CHUNK_SIZE)
    _check_byte_count("chunk_size", chunk_size)
    if workers is None:
        workers = os.cpu_count() or 1
    if not _is_int(workers) or workers < 1:
        raise ValueError(f"`workers` must be a positive int. Received: workers={workers!r}")
    if encoder and seq_len - 3 < 2:
        raise ValueError(
            "`seq_len` must leave room for 2 tokens after [CLS] and two [SEP]. "
            f"Received: seq_len={seq_len}"
        )
    if vocabulary_size is None and tokenizer_path is None:
        raise ValueError(
            "`vocabulary_size` is required to train a tokenizer (or pass `tokenizer_path`). "
            "Received: vocabulary_size=None, tokenizer_path=None"
        )
    if inputs is not None and len(inputs) == 0:
        raise ValueError("`inputs` must be None (default corpus) or non-empty. Received: []")
    files = [] if inputs is None else resolve_inputs(inputs)
    tfds = list(tfds)
    if inputs is None and not tfds:
        from pipelines import default_corpus

        sources = [Source(default_corpus.describe(), "default", 0)]
        log(f"no --input: using {default_corpus.describe()}")
    else:
        sources = make_sources(files, tfds)
        names = [source.path for source in sources]
        log(f"{len(sources)} input(s): {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    tokenizer = None
    if tokenizer_path is not None:
        tokenizer = tokenizer_training.load_reused(tokenizer_path, vocabulary_size, record_format)
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // workers)

    if os.path.exists(output_directory) and not os.path.isdir(output_directory):
        raise DataError(f"{output_directory}: output path exists and is not a directory")
    os.makedirs(output_directory, exist_ok=True)
    lock = resume.DirectoryLock(output_directory)
    try:
        existing = resume.existing_dataset_files(output_directory)
        if existing and not overwrite:
            raise DataError(
                f"{output_directory}: output directory already contains a dataset "
                f"({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}); "
                "pass --overwrite to replace it"
            )
        chunks = plan_chunks(sources, chunk_size)
        record_length = seq_len - 3 if encoder else seq_len + 1
        splits = ["train"] + (["val"] if val_fraction > 0 else [])
        # Everything that decides the output: a rerun resumes only if it matches.
        settings = {
            "inputs": fingerprint(sources),
            "seq_len": seq_len,
            "vocabulary_size": vocabulary_size,
            "tokenizer": (
                None if tokenizer is None else hashlib.sha256(tokenizer.model_proto).hexdigest()
            ),
            "eos_token": None if tokenizer is None else tokenizer_training.eos_token(tokenizer),
            "tokenizer_type": tokenizer_type,
            "shard_size": shard_size,
            "chunk_size": chunk_size,
            "val_fraction": val_fraction,
            "seed": seed,
            "tokenizer_sample_bytes": tokenizer_sample_bytes,
            "format": record_format,
            "compression": compression,
            "text_key": text_key,
            **({"too_long": too_long, "learn": learn, "chat_template": chat.spec()}
               if instructions else {}),
            **({"pack": True} if pack else {}),
        }
        job = {
            "sources": [(source.path, source.kind, source.size) for source in sources],
            "output_directory": output_directory,
            "seed": seed,
            "text_key": None if instructions else text_key,  # None: examples
            "too_long": too_long,
            "learn": learn,
            "chat_template": chat.spec() if chat else None,
            "tfds_data_dir": tfds_data_dir,
            "sample_bytes": tokenizer_sample_bytes,
            "collect_sample": tokenizer is None,
            "record_length": record_length,
            "shard_size": shard_size,
            "compression": compression,
            "format": record_format,
            "pack": pack,
            "splits": splits,
            "num_threads": num_threads,
        }
        timings = {}
        total_input_bytes = sum(source.size for source in sources)

        # Scan and tokenizer, or both from an interrupted run's state.
        state = resume.resumable_state(output_directory, settings, log)
        if state is None:
            with ChunkRunner(job, min(workers, len(chunks))) as runner:
                scan = scan_chunks(runner, chunks, sources, val_fraction, total_input_bytes, log)
            timings["scan_seconds"] = scan.pop("seconds")
            start = time.perf_counter()
            sample = scan.pop("sample")
            sample_bytes = sum(len(text.encode("utf-8")) for text in sample)
            if tokenizer is None:
                log(
                    f"tokenizer: training {tokenizer_type}, vocabulary_size={vocabulary_size}, "
                    f"on {len(sample):,} documents ({sample_bytes / 1e6:,.1f} MB)"
                )
                tokenizer = tokenizer_training.train(
                    sample, tokenizer_type, vocabulary_size, max(workers, num_threads), encoder
                )
            tokenizer_temporary = tokenizer_training.temporary_path(output_directory, tokenizer)
            write_atomically(tokenizer_temporary, tokenizer.model_proto)
            timings["tokenizer_seconds"] = time.perf_counter() - start
            log(f"tokenizer done in {timings['tokenizer_seconds']:.1f} s")
            state = {
                "version": resume.STATE_VERSION,
                "settings": settings,
                "scan": dict(scan, sample_documents=len(sample), sample_bytes=sample_bytes),
                "tokenizer_file": os.path.basename(tokenizer_temporary),
                "tokenizer_sha256": hashlib.sha256(tokenizer.model_proto).hexdigest(),
                "eos_token": tokenizer_training.eos_token(tokenizer),
                "chunks": {},
            }
            del sample
            resume.write_state(output_directory, state)
        else:
            tokenizer_temporary = os.path.join(output_directory, state["tokenizer_file"])
            tokenizer = tokenizer_training.load_temporary(tokenizer_temporary,
                                                          state.get("eos_token"))
        scan = state["scan"]
        job["tokenizer_path"] = tokenizer_temporary
        job["eos_token"] = state.get("eos_token")
        job["validation_bin_threshold"] = scan["validation_bin_threshold"]
        if encoder and not tokenizer_training.has_encoder_pieces(tokenizer):
            raise ValueError(
                "--format encoder needs a tokenizer with [CLS], [SEP] and [MASK] pieces"
            )

        # Encode and write.
        progress = Progress("encode+write", total_input_bytes, log, interactive_progress)
        chunk_results = encode_chunks(job, chunks, sources, state, workers, progress, log)
        timings["encode_and_write_seconds"] = progress.elapsed()
        _check_results(
            chunk_results, scan, chunks, sources, splits, record_format, seq_len, val_fraction
        )
        manifest = build_manifest(
            chunk_results=chunk_results,
            tokenizer=tokenizer,
            tokenizer_path=tokenizer_path,
            scan=scan,
            sources=sources,
            inputs=inputs,
            tfds=tfds,
            seq_len=seq_len,
            record_length=record_length,
            record_format=record_format,
            compression=compression,
            seed=seed,
            val_fraction=val_fraction,
            shard_size=shard_size,
            chunk_size=chunk_size,
            number_of_chunks=len(chunks),
            instructions=({"too_long": too_long, "learn": learn,
                           "chat_template": chat.spec(), "packed": pack}
                          if instructions else None),
        )
        start = time.perf_counter()
        commit(output_directory, tokenizer_temporary, tokenizer.filename, chunk_results, manifest)
        timings["commit_seconds"] = time.perf_counter() - start
    except (KeyboardInterrupt, SystemExit, WorkerDied):
        # An interruption: keep finished chunks and the state for the rerun.
        log(
            "interrupted: rerun the same command to resume; finished chunks are kept in "
            f"{output_directory}"
        )
        raise
    except BaseException:
        resume.remove_temporary_files(output_directory)
        raise
    finally:
        lock.release()

    for split in SPLITS:
        summary = manifest["splits"][split]
        log(
            f"{split}: {len(summary['shards'])} shard(s), {summary['sequences']:,} sequences, "
            f"{summary['tokens']:,} tokens from {summary['documents']:,} documents, "
            f"{summary['dropped_tail_tokens']:,} tail tokens dropped"
        )
        if "learned_tokens" in summary:
            log(f"{split}: {summary['learned_tokens']:,} tokens learned; examples longer than "
                f"--seq-len + 1: {summary['dropped_examples']:,} dropped, "
                f"{summary['truncated_examples']:,} truncated (--too-long {too_long})")
        if "fill" in summary:
            log(f"{split}: {summary['documents'] - summary['dropped_examples']:,} examples "
                f"packed into {summary['sequences']:,} records, {summary['fill']:.1%} full")
    log(
        "timings: "
        + ", ".join(
            f"{name.replace('_seconds', '')} {seconds:.1f} s" for name, seconds in timings.items()
        )
        + f"; wrote {os.path.join(output_directory, MANIFEST_FILENAME)}"
    )
    return manifest


def _check_results(
    chunk_results, scan, chunks, sources, splits, record_format, seq_len, val_fraction
):
    """Raise DataError if the input changed since the scan, or a split got no record."""
    for index, result in chunk_results.items():
        expected = scan["chunks"][str(index)]
        if (result["documents"], result["bytes"]) != tuple(expected):
            raise DataError(
                f"the input changed while being prepared: chunk {index} "
                f"({describe_chunk(sources, chunks[index])}) had "
                f"{expected[0]} documents / {expected[1]} bytes in the scan and "
                f"{result['documents']} / {result['bytes']} when encoded"
            )
    for split in splits:
        summary = split_summary(chunk_results, split, record_format)
        if summary["sequences"] == 0 and summary.get("dropped_examples"):
            raise DataError(
                f"the {split} split got no example: all {summary['dropped_examples']:,} were "
                f"longer than --seq-len {seq_len} + 1 tokens; raise --seq-len, or cut them "
                "with --too-long truncate")
        if summary["sequences"] == 0:
            raise DataError(
                f"corpus too small for --seq-len {seq_len} and --val-fraction "
                f"{val_fraction}: the {split} split got {summary['tokens']:,} tokens from "
                f"{summary['documents']:,} document(s), but one record needs "
                f"{seq_len + 1 if record_format == 'packed' else 2}; add text, lower --seq-len"
                + (" or raise --val-fraction" if split == "val" else "")
            )
