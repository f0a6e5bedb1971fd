"""Step 2 of `pipelines.prepare`, the scan: split histogram and tokenizer sample.

Every document is hashed with a keyed BLAKE2b (`document_digest`, keyed by
`--seed`): the top 16 bits pick one of `SPLIT_HASH_BINS` bins and the
lowest bins, just enough to hold `--val-fraction` of the corpus's bytes, go
to validation (`document_split`); bytes 8-15 are the key of the
tokenizer's training sample, the training documents with the smallest
keys that fit `--tokenizer-sample-bytes`. Chunks are scanned in worker
processes (`scan_chunk`) and merged in the main process (`scan_chunks`);
the result does not depend on the order chunks finish in.
"""

import hashlib
import heapq
from typing import List

import numpy as np

from pipelines.chat_template import ChatTemplate
from pipelines.errors import DataError
from pipelines.prepare.progress import Progress
from pipelines.sources import ChunkReader, Source

# The split decision uses the top 16 bits of each document's hash, so the
# validation share can be chosen to a resolution of 1/65536 of the key space.
SPLIT_HASH_BINS = 1 << 16


def document_digest(document_bytes: bytes, seed: int) -> bytes:
    """16-byte keyed hash; bytes 0-1 pick the split bin, bytes 8-15 the sample key."""
    return hashlib.blake2b(document_bytes, digest_size=16, key=seed.to_bytes(8, "little")).digest()


def _split_bin(digest: bytes) -> int:
    return int.from_bytes(digest[:2], "big")


def document_split(data: bytes, seed: int, validation_bin_threshold: int) -> str:
    """"val" if the document's hash falls in the lowest `validation_bin_threshold` bins."""
    return "val" if _split_bin(document_digest(data, seed)) < validation_bin_threshold else "train"


class _ByteBudgetSampler:
    """The documents with the smallest random keys whose bytes fit a budget.

    Exactly the longest prefix, in key order, of all offered documents whose
    sizes sum to at most the budget, whatever the order of the offers: so
    per-chunk samplers merged in any order give the single-pass result. A
    document larger than the whole budget is truncated to it.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.total_bytes = 0
        self._heap = []  # Max-heap on the key via negation: (-key, text, bytes, bin).
        self._cutoff = None  # Smallest key ever evicted: no larger key may enter.

    def offer(self, key: int, text: str, size: int, split_bin: int) -> None:
        if self._cutoff is not None and key >= self._cutoff:
            return
        if size > self.budget_bytes:
            text = text.encode("utf-8")[: self.budget_bytes].decode("utf-8", "ignore")
            size = len(text.encode("utf-8"))
        heapq.heappush(self._heap, (-key, text, size, split_bin))
        self.total_bytes += size
        while self.total_bytes > self.budget_bytes:
            negative_key, _, removed_size, _ = heapq.heappop(self._heap)
            self.total_bytes -= removed_size
            self._cutoff = -negative_key

    def entries(self) -> list:
        """(key, text, bytes, bin) of the kept documents (for merging)."""
        return [
            (-negative_key, text, size, split_bin)
            for negative_key, text, size, split_bin in self._heap
        ]

    def documents(self, exclude_bins_below: int) -> List[str]:
        """The kept documents in key order, minus those in validation bins."""
        kept = sorted(self._heap, reverse=True)  # Ascending key.
        return [text for _, text, _, split_bin in kept if split_bin >= exclude_bins_below]


def _validation_bin_threshold(histogram, val_fraction: float) -> int:
    """Smallest number of leading bins holding at least `val_fraction` of the bytes."""
    if val_fraction <= 0.0:
        return 0
    cumulative = np.cumsum(np.asarray(histogram, dtype=np.int64))
    target = val_fraction * float(cumulative[-1])
    reached = np.nonzero((cumulative >= target) & (cumulative > 0))[0]
    return int(reached[0]) + 1 if reached.size else len(cumulative)


def chunk_reader(job: dict, segments, counters) -> ChunkReader:
    """The documents of one chunk (`[source_index, start, end]` segments), counting input bytes."""
    sources = [Source(*source) for source in job["sources"]]
    chat = job.get("chat_template")
    return ChunkReader(
        sources,
        segments,
        text_key=job["text_key"],
        tfds_data_dir=job["tfds_data_dir"],
        on_progress=lambda consumed: counters.add(0, 0, consumed),
        chat=ChatTemplate(**chat) if chat else None,
    )


def scan_chunk(job, chunk_index, segments, counters) -> dict:
    """Pass 1 over one chunk: counts, split histogram, tokenizer sample candidates."""
    histogram = np.zeros(SPLIT_HASH_BINS, dtype=np.int64)
    sampler = _ByteBudgetSampler(job["sample_bytes"]) if job["collect_sample"] else None
    reader = chunk_reader(job, segments, counters)
    documents = total_bytes = pending_documents = pending_bytes = 0
    for _, text in reader:
        data = text.encode("utf-8")
        digest = document_digest(data, job["seed"])
        bin_index = _split_bin(digest)
        histogram[bin_index] += len(data)
        if sampler is not None:
            sampler.offer(int.from_bytes(digest[8:], "big"), text, len(data), bin_index)
        documents += 1
        total_bytes += len(data)
        pending_documents += 1
        pending_bytes += len(data)
        if pending_documents >= 1000:
            counters.add(pending_documents, pending_bytes, 0)
            pending_documents = pending_bytes = 0
    counters.add(pending_documents, pending_bytes, 0)
    return {
        "chunk": chunk_index,
        "documents": documents,
        "bytes": total_bytes,
        "empty_documents": reader.empty_documents,
        "documents_per_source": reader.documents_per_source,
        "histogram": histogram,
        "sample": sampler.entries() if sampler is not None else [],
    }


def scan_chunks(runner, chunks, sources, val_fraction, total_input_bytes, log) -> dict:
    """Pass 1 over every chunk: counts, the validation threshold and the sample."""
    progress = Progress("scan", total_input_bytes, log)
    histogram = np.zeros(SPLIT_HASH_BINS, dtype=np.int64)
    sampler = _ByteBudgetSampler(runner.job["sample_bytes"])
    per_chunk = {}
    per_source = {}
    empty_documents = 0
    for result in runner.run("scan", list(enumerate(chunks)), progress):
        histogram += result["histogram"]
        for entry in result["sample"]:
            sampler.offer(*entry)
        per_chunk[str(result["chunk"])] = [result["documents"], result["bytes"]]
        for source_index, count in result["documents_per_source"].items():
            per_source[source_index] = per_source.get(source_index, 0) + count
        empty_documents += result["empty_documents"]
    for source_index, source in enumerate(sources):
        if per_source.get(source_index, 0) == 0:
            raise DataError(f"{source.path}: empty input (no non-whitespace text)")
    documents = sum(count for count, _ in per_chunk.values())
    total_bytes = sum(size for _, size in per_chunk.values())
    threshold = _validation_bin_threshold(histogram, val_fraction)
    validation_bytes = int(histogram[:threshold].sum())
    if threshold > 0 and validation_bytes == total_bytes:
        raise DataError(
            f"corpus too small to split: all {documents} document(s) would go to the "
            f"validation split with --val-fraction {val_fraction}; add documents or "
            "use --val-fraction 0"
        )
    progress.done(
        documents,
        total_bytes,
        f"; validation gets {validation_bytes / max(total_bytes, 1):.1%} of the bytes",
    )
    return {
        "documents": documents,
        "bytes": total_bytes,
        "empty_documents": empty_documents,
        "validation_bin_threshold": threshold,
        "chunks": per_chunk,
        "sample": sampler.documents(exclude_bins_below=threshold),
        "seconds": progress.elapsed(),
    }
