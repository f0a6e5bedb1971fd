"""Step 4 of `pipelines.prepare`, encoding: worker processes that encode chunks.

`ChunkRunner` runs per-chunk tasks (the scan's and the encoding's) in a
process pool of `--workers` processes, or in this process for one worker;
`encode_chunk` reads one chunk, encodes its documents in batches of at most
`ENCODE_BATCH_DOCUMENTS` documents or `ENCODE_BATCH_BYTES` bytes and writes
the chunk's shards; `encode_chunks` encodes every chunk an interrupted run
has not finished and records each finished chunk in the resume state.

Workers are forked (spawned once TensorFlow is loaded: forking its threads
can deadlock), ignore Ctrl-C (the main process handles it) and exit when
the main process dies. A worker that dies fails the run at once with
`WorkerDied`, an interruption: finished chunks are kept for the rerun.
"""

import concurrent.futures
import multiprocessing
import os
import signal
import sys
import threading
import time

from pipelines.prepare import resume
from pipelines.prepare.progress import Counters, Progress
from pipelines.prepare.scan import chunk_reader, document_split, scan_chunk
from pipelines.prepare.shard_writer import SplitWriter, split_segments
from pipelines.prepare.tokenizer_training import load_temporary
from pipelines.sources import chunk_input_bytes, parse_example_document

# Documents are encoded in batches of this many documents or bytes, whichever
# comes first, so SentencePiece has work and memory stays bounded.
ENCODE_BATCH_DOCUMENTS = 1024
ENCODE_BATCH_BYTES = 512 << 10
# Peak resident memory of any prepare process with a given SentencePiece
# tokenizer, whatever the corpus size (see `pipelines.prepare`).
MEMORY_BOUND_MB = 60


_WORKER = {"job": None, "counters": None, "tokenizer": None}


def _exit_when_orphaned(parent_pid: int) -> None:
    """End this worker if the main process dies (e.g. `kill -9`): nobody will collect its work."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _initialize_worker(job: dict, shared_counters) -> None:
    # Ctrl-C goes to the whole process group: the parent handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    _WORKER["job"] = job
    _WORKER["counters"] = Counters(shared_counters)
    _WORKER["tokenizer"] = None


def _worker_tokenizer(job: dict):
    if _WORKER["tokenizer"] is None:
        _WORKER["tokenizer"] = load_temporary(job["tokenizer_path"], job["eos_token"])
    return _WORKER["tokenizer"]


def _run_task(task):
    phase, chunk_index, segments = task
    function = scan_chunk if phase == "scan" else encode_chunk
    return function(_WORKER["job"], chunk_index, segments, _WORKER["counters"])


def encode_chunk(job, chunk_index, segments, counters) -> dict:
    """Pass 2 over one chunk: encode, pack and write this chunk's shards."""
    tokenizer = _worker_tokenizer(job)
    writers = {
        split: SplitWriter(
            split,
            job["output_directory"],
            chunk_index,
            job["record_length"],
            job["shard_size"],
            job["compression"],
            job["format"],
            pack=job.get("pack", False),
        )
        for split in job["splits"]
    }
    encoder = job["format"] == "encoder"
    instructions = job["format"] == "instructions"
    threshold = job["validation_bin_threshold"]
    reader = chunk_reader(job, segments, counters)
    batch_texts, batch_splits = [], []
    state = {"documents": 0, "bytes": 0, "batch_bytes": 0}

    def flush():
        if instructions:
            examples = [parse_example_document(text) for text in batch_texts]
            encoded = iter(tokenizer.encode_batch(
                [text for pieces in examples for text, _ in pieces],
                num_threads=job["num_threads"]))
            learn_all = job["learn"] == "all"
            token_lists = [[(next(encoded), learned or learn_all) for _, learned in pieces]
                           for pieces in examples]
        elif encoder:
            segment_lists = [split_segments(text) for text in batch_texts]
            flat = [segment for segments_of_one in segment_lists for segment in segments_of_one]
            encoded = tokenizer.encode_batch(flat, num_threads=job["num_threads"])
            token_lists, position = [], 0
            for segments_of_one in segment_lists:
                token_lists.append(encoded[position : position + len(segments_of_one)])
                position += len(segments_of_one)
        else:
            token_lists = tokenizer.encode_batch(batch_texts, num_threads=job["num_threads"])
        for split, writer in writers.items():
            selected = [
                token_ids
                for token_ids, document_split in zip(token_lists, batch_splits)
                if document_split == split
            ]
            if instructions:
                writer.add_examples(selected, tokenizer.eos_id, job["too_long"])
            elif encoder:
                writer.add_segmented_documents(selected)
            else:
                writer.add_documents(selected, tokenizer.eos_id)
        counters.add(len(batch_texts), state["batch_bytes"], 0)
        batch_texts.clear()
        batch_splits.clear()
        state["batch_bytes"] = 0

    try:
        for _, text in reader:
            data = text.encode("utf-8")
            split = document_split(data, job["seed"], threshold)
            batch_texts.append(text)
            batch_splits.append(split)
            state["batch_bytes"] += len(data)
            state["documents"] += 1
            state["bytes"] += len(data)
            if (
                len(batch_texts) >= ENCODE_BATCH_DOCUMENTS
                or state["batch_bytes"] >= ENCODE_BATCH_BYTES
            ):
                flush()
        if batch_texts:
            flush()
        for writer in writers.values():
            writer.close()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return {
        "chunk": chunk_index,
        "documents": state["documents"],
        "bytes": state["bytes"],
        "empty_documents": reader.empty_documents,
        "splits": {split: writer.summary() for split, writer in writers.items()},
    }


def on_chunk_encoded(chunk_index: int) -> None:
    """Called after each chunk's shards are recorded in the state file (a test hook)."""


class WorkerDied(RuntimeError):
    """A worker process ended abnormally (killed, out of memory): an interruption."""


class ChunkRunner:
    """Runs per-chunk tasks in a process pool, or in this process for one worker.

    The pool is a `concurrent.futures.ProcessPoolExecutor`: a worker that
    dies (`kill -9`, the out-of-memory killer) fails the run at once with
    `WorkerDied` instead of leaving its task waiting forever, as a
    `multiprocessing.Pool` would.
    """

    def __init__(self, job: dict, workers: int):
        self.job = job
        self.workers = workers
        self.counters = Counters()
        self.pool = None
        if workers > 1:
            # fork is fast and inherits everything, but forking a process that
            # has started TensorFlow's threads can deadlock the child.
            method = "spawn" if "tensorflow" in sys.modules else "fork"
            context = multiprocessing.get_context(method)
            shared = context.Array("q", 3)
            self.counters = Counters(shared)
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=context, initializer=_initialize_worker, initargs=(job, shared)
            )
        else:
            _WORKER["job"] = job
            _WORKER["counters"] = self.counters
            _WORKER["tokenizer"] = None

    def run(self, phase: str, chunks, progress: Progress):
        """Yield the results of `phase` over `chunks` ([(index, segments)]) as they finish."""
        tasks = [(phase, index, segments) for index, segments in chunks]
        if self.pool is None:
            self.counters.on_update = lambda: progress.update(*self.counters.values())
            for task in tasks:
                yield _run_task(task)
            self.counters.on_update = None
            return
        pending = {self.pool.submit(_run_task, task) for task in tasks}
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=0.25, return_when=concurrent.futures.FIRST_COMPLETED
            )
            progress.update(*self.counters.values())
            for future in done:
                try:
                    result = future.result()
                except concurrent.futures.process.BrokenProcessPool as error:
                    raise WorkerDied(
                        f"a {phase} worker process died ({error}); finished chunks are kept: "
                        "rerun the same command to resume"
                    ) from None
                yield result

    def __enter__(self) -> "ChunkRunner":
        return self

    def __exit__(self, exception_type, exception, traceback) -> None:
        self.close(terminate=exception_type is not None)

    def close(self, terminate: bool = False) -> None:
        if self.pool is not None:
            if terminate:
                # The executor has no terminate(): stop its processes directly.
                for process in list((self.pool._processes or {}).values()):
                    process.terminate()
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        _WORKER.update(job=None, counters=None, tokenizer=None)


def encode_chunks(job, chunks, sources, state, workers, progress, log) -> dict:
    """Pass 2: encode every chunk an interrupted run has not finished; all chunks' results."""
    directory = job["output_directory"]
    chunk_results = resume.finished_chunks(directory, state, log)
    pending = [
        (index, segments) for index, segments in enumerate(chunks) if index not in chunk_results
    ]
    if chunk_results:
        log(
            f"resuming: {len(chunk_results)} of {len(chunks)} chunk(s) already written "
            "(checksums verified); encoding the rest"
        )
    with ChunkRunner(job, min(workers, max(len(pending), 1))) as runner:
        finished_bytes = sum(chunk_input_bytes(sources, chunks[index]) for index in chunk_results)
        runner.counters.add(0, 0, finished_bytes)
        for result in runner.run("encode", pending, progress):
            index = result["chunk"]
            chunk_results[index] = result
            state["chunks"][str(index)] = result
            resume.write_state(directory, state)  # This chunk is now safe from a crash.
            on_chunk_encoded(index)
    tokens = sum(
        summary["tokens"]
        for result in chunk_results.values()
        for summary in result["splits"].values()
    )
    progress.done(
        sum(result["documents"] for result in chunk_results.values()),
        sum(result["bytes"] for result in chunk_results.values()),
        f", {tokens:,} tokens",
    )
    return chunk_results
