"""Step 5 of `pipelines.prepare`: the manifest, and the renames that publish a data directory.

The chunks' temporary shards get their final names,
`{split}-{index:05d}-of-{count:05d}.tfrecord`, numbered in chunk order and
then in write order within a chunk, and `manifest.json` (its schema is
`pipelines.manifest.Manifest`) is written last: a directory without it is
not a dataset, whatever else it holds.
"""

import hashlib
import json
import os
from typing import List

from pipelines.files import fsync_directory, write_atomically
from pipelines.manifest import (
    MANIFEST_FILENAME,
    RECORD_FORMATS,
    SPLITS,
    Manifest,
    Shard,
    Split,
    TokenizerDescription,
    Totals,
    format_version,
    record_feature,
    shard_filename,
)
from pipelines.prepare.resume import STATE_FILENAME, existing_dataset_files
from pipelines.prepare.tokenizer_training import TOKENIZER_FILENAMES
from pipelines.wordpiece_tokenizer import VOCABULARY_FILENAME
from tfgpt.hf_files import TOKENIZER_JSON_FILE

# The manifest's tokenizer `type` of each tokenizer file; a `tokenizer.model` is SentencePiece.
TOKENIZER_KINDS = {VOCABULARY_FILENAME: "wordpiece", TOKENIZER_JSON_FILE: "byte-level-bpe"}


def _ordered_shards(chunk_results: dict, split: str) -> List[dict]:
    """The split's shards in chunk order, then write order within a chunk."""
    shards = []
    for chunk_index in sorted(chunk_results):
        summary = chunk_results[chunk_index]["splits"].get(split)
        if summary:
            for shard in summary["shards"]:
                shards.append(dict(shard, chunk=chunk_index))
    return shards


def split_summary(chunk_results: dict, split: str, record_format: str,
                  record_length: int = 0, packed: bool = False) -> Split:
    """One split's entry of the manifest, summed over the chunks' results
    (`packed` instruction data: with the records' `fill` of `record_length`)."""
    shards = _ordered_shards(chunk_results, split)
    summaries = [
        result["splits"][split] for result in chunk_results.values() if split in result["splits"]
    ]
    counts = {
        key: sum(item[key] for item in summaries)
        for key in ("documents", "tokens", "sequences", "dropped_tail_tokens")
    }
    extra = {"encoder": ("segments",),
             "instructions": ("learned_tokens", "dropped_examples", "truncated_examples")}
    for key in extra.get(record_format, ()):
        counts[key] = sum(item.get(key, 0) for item in summaries)
    if packed:
        slots = counts["sequences"] * record_length
        counts["fill"] = round(counts["tokens"] / slots, 6) if slots else 0.0
    return Split(
        **counts,
        shards=[
            Shard(
                filename=shard_filename(split, index, len(shards)),
                sequences=shard["sequences"],
                tokens=shard["tokens"],
                bytes=shard["bytes"],
                sha256=shard["sha256"],
                chunk=shard["chunk"],
            )
            for index, shard in enumerate(shards)
        ],
    )


def _tokenizer_description(
    tokenizer, tokenizer_path, sample_documents, sample_bytes
) -> TokenizerDescription:
    return TokenizerDescription(
        type=TOKENIZER_KINDS.get(tokenizer.filename, "sentencepiece"),
        **tokenizer.settings(),
        model_file=tokenizer.filename,
        sha256=hashlib.sha256(tokenizer.model_proto).hexdigest(),
        vocabulary_size=tokenizer.vocabulary_size,
        pad_id=tokenizer.pad_id,
        unk_id=tokenizer.unk_id,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        eos_piece=tokenizer.id_to_piece(tokenizer.eos_id),
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        mask_id=tokenizer.mask_id,
        trained=tokenizer_path is None,
        source=None if tokenizer_path is None else os.path.abspath(tokenizer_path),
        sample_documents=None if tokenizer_path else sample_documents,
        sample_bytes=None if tokenizer_path else sample_bytes,
    )


def build_manifest(
    *,
    chunk_results,
    tokenizer,
    tokenizer_path,
    scan,
    sources,
    inputs,
    tfds,
    seq_len,
    record_length,
    record_format,
    compression,
    seed,
    val_fraction,
    shard_size,
    chunk_size,
    number_of_chunks,
    instructions=None,
) -> Manifest:
    """The manifest's contents; `pipelines.manifest.Manifest` describes the keys
    (`instructions`: the instruction format's `too_long`, `learn`,
    `chat_template` and `packed`)."""
    packed = bool((instructions or {}).get("packed"))
    splits = {split: split_summary(chunk_results, split, record_format, record_length, packed)
              for split in SPLITS}
    return Manifest(
        format=RECORD_FORMATS[record_format],
        format_version=format_version(record_format, compression, packed),
        feature=record_feature(record_format),
        seq_len=seq_len,
        record_length=record_length,
        **(instructions or {}),
        compression=compression,
        tokenizer=_tokenizer_description(
            tokenizer, tokenizer_path, scan["sample_documents"], scan["sample_bytes"]
        ),
        splits=splits,
        totals=Totals(
            documents=scan["documents"],
            input_bytes=scan["bytes"],
            skipped_empty_documents=scan["empty_documents"],
            tokens=sum(split["tokens"] for split in splits.values()),
            sequences=sum(split["sequences"] for split in splits.values()),
            dropped_tail_tokens=sum(split["dropped_tail_tokens"] for split in splits.values()),
        ),
        inputs=[
            source.path if source.kind in ("default", "tfds") else os.path.abspath(source.path)
            for source in sources
        ],
        input_patterns=None if inputs is None else list(inputs),
        tfds=list(tfds) or None,
        seed=seed,
        val_fraction=val_fraction,
        shard_size=shard_size,
        chunk_size=chunk_size,
        chunks=number_of_chunks,
        split_rule=(
            "document to val iff the top 16 bits of blake2b(text, key=seed as 8 "
            f"little-endian bytes, digest_size=16) < {scan['validation_bin_threshold']}"
        ),
    )


def commit(
    directory: str,
    tokenizer_temporary: str,
    tokenizer_filename: str,
    chunk_results: dict,
    manifest: Manifest,
) -> None:
    """Move temporaries to final names, then write the manifest last."""
    # Remove the old manifest first: from here until the new one is written the
    # directory is, correctly, not a dataset.
    manifest_path = os.path.join(directory, MANIFEST_FILENAME)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)
    for name in existing_dataset_files(directory):
        os.remove(os.path.join(directory, name))
    for name in TOKENIZER_FILENAMES:
        if name != tokenizer_filename and os.path.exists(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))
    fsync_directory(directory)
    os.replace(tokenizer_temporary, os.path.join(directory, tokenizer_filename))
    for split in SPLITS:
        shards = _ordered_shards(chunk_results, split)
        for index, shard in enumerate(shards):
            os.replace(
                os.path.join(directory, shard["temporary_name"]),
                os.path.join(directory, shard_filename(split, index, len(shards))),
            )
    fsync_directory(directory)
    write_atomically(manifest_path, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    os.remove(os.path.join(directory, STATE_FILENAME))
    fsync_directory(directory)
