"""Preparation at corpus scale: chunking, workers, resume, compression, memory, inputs, tokenizers.

Oracles: the documents a test wrote itself (chunked reading must yield each
exactly once, in order), an uninterrupted or single-worker run (a resumed or
parallel run must produce byte-identical shards), and the uncompressed
shards (GZIP shards must read back to the same records).
"""

import fcntl
import glob
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from pipelines import prepare, reader, sources
from pipelines.errors import DataError
from pipelines.prepare import encoding, progress
from pipelines.tokenizer import Tokenizer, train_tokenizer
from tests.test_pipelines import (
    SEQ_LEN,
    SPECIAL_JSON_DOCUMENTS,
    SPECIAL_TEXT_DOCUMENTS,
    VOCABULARY_SIZE,
    decode_documents,
    make_documents,
    read_records,
    read_stream,
    write_json_lines_file,
    write_text_file,
)

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shard_digests(data_dir):
    """{filename: sha256} of every shard, read from disk (not the manifest)."""
    digests = {}
    for path in sorted(glob.glob(os.path.join(data_dir, "*.tfrecord"))):
        with open(path, "rb") as shard_file:
            digests[os.path.basename(path)] = hashlib.sha256(shard_file.read()).hexdigest()
    return digests


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.model"
    train_tokenizer(
        make_documents(200, seed=11) + SPECIAL_TEXT_DOCUMENTS,
        VOCABULARY_SIZE,
        str(path),
        num_threads=1,
    )
    return str(path)


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """Six input files, about 40 KB, for multi-chunk runs."""
    directory = tmp_path_factory.mktemp("many")
    documents = []
    for index in range(3):
        batch = make_documents(80, seed=100 + index)
        write_json_lines_file(directory / f"part-{index}.jsonl", batch)
        documents += batch
    for index in range(3):
        batch = make_documents(80, seed=200 + index)
        write_text_file(directory / f"notes-{index}.txt", batch)
        documents += batch
    inputs = sorted(glob.glob(str(directory / "*.jsonl"))) + sorted(
        glob.glob(str(directory / "*.txt"))
    )
    return {"inputs": inputs, "documents": documents}


def run(output, input_paths, tokenizer_path=None, **options):
    arguments = dict(
        output_directory=str(output),
        inputs=[str(path) for path in input_paths],
        seq_len=SEQ_LEN,
        shard_size=2048,
        chunk_size=6000,
        val_fraction=0.2,
        seed=3,
        workers=1,
        log=lambda message: None,
    )
    if tokenizer_path is None:
        arguments["vocabulary_size"] = VOCABULARY_SIZE
    else:
        arguments["tokenizer_path"] = tokenizer_path
    arguments.update(options)
    return prepare.prepare(**arguments)


@pytest.fixture(scope="module")
def reference_run(many_files, tokenizer_path, tmp_path_factory):
    """The uninterrupted single-worker run every other run must reproduce."""
    output = tmp_path_factory.mktemp("reference")
    manifest = run(output, many_files["inputs"], tokenizer_path)
    return str(output), manifest


# ----------------------------------------------------------------------------
# Chunked reading: every document exactly once, whatever the cut points.


def read_all_chunks(file_sources, chunk_size):
    documents = []
    for segments in sources.plan_chunks(file_sources, chunk_size):
        documents.extend(text for _, text in sources.ChunkReader(file_sources, segments))
    return documents


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 333, 1000, 1 << 20])
def test_chunked_reading_yields_every_document_once_in_order(tmp_path, chunk_size):
    generator = random.Random(chunk_size)
    text_documents = SPECIAL_TEXT_DOCUMENTS + make_documents(25, seed=5)
    json_documents = SPECIAL_JSON_DOCUMENTS + make_documents(25, seed=6)
    write_text_file(tmp_path / "a.txt", text_documents, crlf=generator.random() < 0.5)
    # Leading blank lines and a whitespace-only JSON text (skipped, not a document).
    (tmp_path / "b.txt").write_text("\n \n" + "\n\n".join(make_documents(9, seed=7)) + "\n")
    write_json_lines_file(tmp_path / "c.jsonl", json_documents, extra_lines=['{"text": " "}', ""])
    files = [str(tmp_path / name) for name in ("a.txt", "b.txt", "c.jsonl")]
    expected = text_documents + make_documents(9, seed=7) + json_documents
    assert read_all_chunks(sources.make_sources(files), chunk_size) == expected
    if chunk_size < 100:
        assert len(sources.plan_chunks(sources.make_sources(files), chunk_size)) > 20


def test_zstandard_json_lines_are_streamed_like_the_plain_file(tmp_path):
    import zstandard

    documents = SPECIAL_JSON_DOCUMENTS + make_documents(300, seed=8)
    write_json_lines_file(tmp_path / "plain.jsonl", documents)
    data = (tmp_path / "plain.jsonl").read_bytes()
    # Several frames, as concatenated Pile parts would have.
    compressor = zstandard.ZstdCompressor(level=3)
    half = len(data) // 2
    (tmp_path / "pile.jsonl.zst").write_bytes(
        compressor.compress(data[:half]) + compressor.compress(data[half:])
    )
    file_sources = sources.make_sources([str(tmp_path / "pile.jsonl.zst")])
    assert file_sources[0].kind == "jsonl.zst"
    # Not cut at byte offsets, whatever the chunk size.
    assert sources.plan_chunks(file_sources, 10) == [[[0, 0, None]]]
    assert read_all_chunks(file_sources, 10) == documents
    (tmp_path / "broken.jsonl.zst").write_bytes(compressor.compress(data)[:-40])
    with pytest.raises(DataError, match=r"broken.jsonl.zst: corrupt Zstandard stream"):
        read_all_chunks(sources.make_sources([str(tmp_path / "broken.jsonl.zst")]), 10)
    # A directory picks up .jsonl.zst files.
    assert str(tmp_path / "pile.jsonl.zst") in sources.resolve_inputs([str(tmp_path)])


def test_errors_in_a_cut_file_name_the_byte_offset(tmp_path):
    lines = [json.dumps({"text": f"document {index}"}) for index in range(200)]
    lines[150] = '{"text": "broken'
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    file_sources = sources.make_sources([str(tmp_path / "data.jsonl")])
    offset = sum(len(line) + 1 for line in lines[:150])
    with pytest.raises(DataError, match=rf"data.jsonl \(line at byte {offset}\): malformed JSON"):
        read_all_chunks(file_sources, 500)
    with pytest.raises(DataError, match=r"data.jsonl:151: malformed JSON"):
        read_all_chunks(file_sources, 1 << 20)


# ----------------------------------------------------------------------------
# Parallel, deterministic, resumable.


def test_reference_run_has_many_chunks_and_round_trips(many_files, reference_run):
    data_dir, manifest = reference_run
    assert manifest["chunks"] >= 5
    assert len(manifest["splits"]["train"]["shards"]) >= manifest["chunks"]
    tokenizer = Tokenizer.load(data_dir)
    documents = many_files["documents"]
    decoded = []
    for split in ("train", "val"):
        # Each chunk's records continue one stream across its shards, and a
        # chunk starts at a document boundary.
        streams = {}
        for shard in manifest["splits"][split]["shards"]:
            path = os.path.join(data_dir, shard["filename"])
            streams.setdefault(shard["chunk"], []).extend(
                token
                for serialized in tf.data.TFRecordDataset(path)
                for token in tf.train.Example.FromString(serialized.numpy())
                .features.feature["input_ids"]
                .int64_list.value
            )
        for stream in streams.values():
            complete, _ = decode_documents(tokenizer, stream)
            decoded += complete
    # Only the documents cut by a chunk's dropped tail are not decoded whole
    # (the test's documents are shorter than a record); none appears twice.
    assert len(decoded) == len(set(decoded))
    assert set(decoded) <= set(documents)
    assert len(decoded) >= len(documents) - 2 * 2 * manifest["chunks"]
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == len(
        documents
    )


def test_two_workers_write_byte_identical_shards(
    many_files, tokenizer_path, reference_run, tmp_path
):
    data_dir, manifest = reference_run
    parallel = run(tmp_path / "two", many_files["inputs"], tokenizer_path, workers=2)
    assert parallel["splits"] == manifest["splits"]
    assert shard_digests(tmp_path / "two") == shard_digests(data_dir)


def test_resume_after_interrupt_skips_finished_chunks(
    many_files, tokenizer_path, reference_run, tmp_path, monkeypatch
):
    data_dir, manifest = reference_run
    finished = []

    def interrupt_after_two(chunk_index):
        finished.append(chunk_index)
        if len(finished) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(encoding, "on_chunk_encoded", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "out", many_files["inputs"], tokenizer_path)
    names = os.listdir(tmp_path / "out")
    assert prepare.STATE_FILENAME in names and "manifest.json" not in names
    assert prepare.LOCK_FILENAME not in names
    # Corrupt one finished chunk's shard: that chunk alone is encoded again.
    with open(tmp_path / "out" / prepare.STATE_FILENAME) as state_file:
        state = json.load(state_file)
    damaged = state["chunks"][str(finished[1])]["splits"]["train"]["shards"][0]["temporary_name"]
    with open(tmp_path / "out" / damaged, "r+b") as shard_file:
        shard_file.seek(30)
        shard_file.write(b"\xff")

    monkeypatch.setattr(encoding, "on_chunk_encoded", finished.append)
    finished.clear()
    messages = []
    resumed = run(tmp_path / "out", many_files["inputs"], tokenizer_path, log=messages.append)
    assert any(message.startswith("resuming: 1 of ") for message in messages), messages
    assert len(finished) == manifest["chunks"] - 1
    assert resumed["splits"] == manifest["splits"]
    assert shard_digests(tmp_path / "out") == shard_digests(data_dir)
    assert not [name for name in os.listdir(tmp_path / "out") if name.startswith(".")]


def run_patched_prepare(patch, output, many_files, tokenizer_path, crash):
    """`prepare.main` in a new process with 2 workers, after `patch` (code) changes `encoding`.

    The patch crashes only when `crash` (it sees CRASH in the environment);
    the same command without it is the rerun.
    """
    script = (
        "import os, signal, sys\n"
        "from pipelines import prepare\n"
        "from pipelines.prepare import encoding\n"
        + textwrap.dedent(patch)
        + "sys.exit(prepare.main(sys.argv[1:]))\n"
    )
    argv = [sys.executable, "-c", script, "--output", str(output)]
    argv += ["--seq-len", str(SEQ_LEN), "--tokenizer", tokenizer_path, "--shard-size", "2048"]
    argv += ["--chunk-size", "6000", "--val-fraction", "0.2", "--seed", "3", "--workers", "2"]
    for path in many_files["inputs"]:
        argv += ["--input", path]
    environment = dict(os.environ, CRASH="1") if crash else None
    # The timeout fails the test if a killed run's workers outlive it
    # (they hold its output pipes open).
    return subprocess.run(
        argv, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_resume_after_kill_9(many_files, tokenizer_path, reference_run, tmp_path):
    """A real crash: the process is killed with SIGKILL after two chunks are recorded."""
    data_dir, _ = reference_run
    patch = """
        finished = []
        def crash(chunk_index):
            finished.append(chunk_index)
            if len(finished) == 2 and os.environ.get("CRASH"):
                os.kill(os.getpid(), signal.SIGKILL)
        encoding.on_chunk_encoded = crash
        """
    output = tmp_path / "out"
    crashed = run_patched_prepare(patch, output, many_files, tokenizer_path, crash=True)
    assert crashed.returncode == -9, crashed.stderr
    assert not glob.glob(str(output / "*.tfrecord"))
    completed = run_patched_prepare(patch, output, many_files, tokenizer_path, crash=False)
    assert completed.returncode == 0, completed.stderr
    assert "resuming: 2 of " in completed.stderr
    assert shard_digests(output) == shard_digests(data_dir)


@pytest.mark.slow
def test_a_dead_worker_fails_the_run_at_once_and_the_rerun_completes(
    many_files, tokenizer_path, reference_run, tmp_path
):
    """A worker killed mid-chunk (as by the out-of-memory killer) must not hang the run."""
    data_dir, _ = reference_run
    patch = """
        real = encoding.encode_chunk
        def dying(job, chunk_index, segments, counters):
            if chunk_index == 3 and os.environ.get("CRASH"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(job, chunk_index, segments, counters)
        encoding.encode_chunk = dying  # Forked workers inherit it.
        """
    output = tmp_path / "out"
    crashed = run_patched_prepare(patch, output, many_files, tokenizer_path, crash=True)
    assert crashed.returncode == 2
    assert "error: a encode worker process died" in crashed.stderr
    assert prepare.STATE_FILENAME in os.listdir(output)
    completed = run_patched_prepare(patch, output, many_files, tokenizer_path, crash=False)
    assert completed.returncode == 0, completed.stderr
    assert shard_digests(output) == shard_digests(data_dir)


def test_changed_input_starts_over(many_files, tokenizer_path, tmp_path, monkeypatch):
    monkeypatch.setattr(
        encoding, "on_chunk_encoded", lambda index: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    inputs = list(many_files["inputs"])
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(open(inputs[0], "rb").read())
    inputs[0] = str(copy)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "out", inputs, tokenizer_path)
    monkeypatch.undo()
    with open(copy, "a") as appended:
        appended.write(json.dumps({"text": "one more document"}) + "\n")
    messages = []
    run(tmp_path / "out", inputs, tokenizer_path, log=messages.append)
    assert any("with other inputs or flags: starting over" in message for message in messages)
    assert not any(message.startswith("resuming") for message in messages)


def test_a_locked_output_directory_is_refused(many_files, tokenizer_path, tmp_path):
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / prepare.LOCK_FILENAME, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        with pytest.raises(
            DataError, match="another pipelines.prepare is writing to this directory"
        ):
            run(tmp_path / "out", many_files["inputs"], tokenizer_path)


def test_progress_reports_documents_rate_and_eta(many_files, tokenizer_path, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_SECONDS", 0.0)
    messages = []
    run(tmp_path / "out", many_files["inputs"], tokenizer_path, log=messages.append)
    lines = [message for message in messages if message.startswith("encode+write: ")]
    assert lines
    assert all(
        " documents, " in line and " MB/s, " in line and "%, ETA " in line for line in lines
    ), lines
    assert lines[-1].split(", ")[-2] == "100%"


# ----------------------------------------------------------------------------
# Memory: bounded whatever the corpus size.


def peak_memory_of_prepare(tmp_path, name, megabytes, tokenizer_path):
    """Peak RSS (MB) of the prepare process and of its largest worker."""
    generator = random.Random(megabytes)
    words = " ".join(make_documents(1, seed=megabytes)).split()
    path = tmp_path / f"{name}.jsonl"
    with open(path, "w") as output_file:
        written = 0
        index = 0
        while written < megabytes << 20:
            text = f"{name} {index}: " + " ".join(generator.choices(words, k=300))
            line = json.dumps({"text": text}) + "\n"
            output_file.write(line)
            written += len(line)
            index += 1
    script = textwrap.dedent("""
        import json, resource, sys
        from pipelines import prepare
        status = prepare.main(sys.argv[1:])
        # Linux keeps RUSAGE_SELF's peak across exec (it would report pytest's
        # own); VmHWM belongs to this process's memory map alone.
        with open("/proc/self/status") as status_file:
            peak = [line for line in status_file if line.startswith("VmHWM:")][0]
        print(json.dumps({
            "status": status,
            "main": int(peak.split()[1]) / 1024,
            "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        }))
        """)
    completed = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "--input",
            str(path),
            "--output",
            str(tmp_path / name),
            "--seq-len",
            "255",
            "--tokenizer",
            tokenizer_path,
            "--shard-size",
            "4M",
            "--chunk-size",
            "1M",
            "--workers",
            "2",
            "--tokenizer-sample-bytes",
            "1M",
        ],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert "tensorflow" not in completed.stderr.lower()  # No TensorFlow start-up chatter.
    return result, written


@pytest.mark.slow
def test_memory_is_bounded_independently_of_corpus_size(tmp_path, tokenizer_path):
    small, small_bytes = peak_memory_of_prepare(tmp_path, "small", 1, tokenizer_path)
    large, large_bytes = peak_memory_of_prepare(tmp_path, "large", 64, tokenizer_path)
    growth = large_bytes - small_bytes
    print(
        f"peak RSS MB: {small_bytes / 1e6:.0f} MB corpus {small}, "
        f"{large_bytes / 1e6:.0f} MB corpus {large}"
    )
    # The stated bound holds for a corpus larger than it: a process that
    # held the corpus (let alone its token ids) would exceed it.
    assert large_bytes / 1e6 > prepare.MEMORY_BOUND_MB
    assert large["main"] < prepare.MEMORY_BOUND_MB, large
    assert large["workers"] < prepare.MEMORY_BOUND_MB, large
    # And the peak does not follow the corpus: 63 MB more text, a few MB more memory.
    for role in ("main", "workers"):
        assert large[role] - small[role] < 0.1 * growth / 1e6, (role, small, large)


# ----------------------------------------------------------------------------
# Compression, inputs, tokenizers.


def test_gzip_shards_read_back_to_the_same_records(
    many_files, tokenizer_path, reference_run, tmp_path
):
    data_dir, manifest = reference_run
    compressed = run(tmp_path / "gzip", many_files["inputs"], tokenizer_path, compression="GZIP")
    assert compressed["compression"] == "GZIP" and compressed["format_version"] == 2
    for split in ("train", "val"):
        plain_shards = manifest["splits"][split]["shards"]
        gzip_shards = compressed["splits"][split]["shards"]
        assert [shard["sequences"] for shard in gzip_shards] == [
            shard["sequences"] for shard in plain_shards
        ]
        assert sum(shard["bytes"] for shard in gzip_shards) < sum(
            shard["bytes"] for shard in plain_shards
        )
    with open(os.path.join(tmp_path / "gzip", gzip_shards[0]["filename"]), "rb") as shard_file:
        assert shard_file.read(2) == b"\x1f\x8b"
    plain = read_records(data_dir, "train")
    gzipped = read_records(str(tmp_path / "gzip"), "train")
    np.testing.assert_array_equal(np.stack(plain), np.stack(gzipped))
    reader.verify_shards(str(tmp_path / "gzip"))
    again = run(tmp_path / "again", many_files["inputs"], tokenizer_path, compression="GZIP")
    assert again["splits"] == compressed["splits"]


def test_tfds_split_from_a_prepared_data_dir(tmp_path):
    import tensorflow_datasets as tfds

    documents = make_documents(120, seed=21)

    def as_dataset(self, *arguments, **keywords):
        return tf.data.Dataset.from_tensor_slices({"text": documents, "title": documents})

    with tfds.testing.mock_data(num_examples=len(documents), as_dataset_fn=as_dataset):
        manifest = run(
            tmp_path / "out",
            [],
            tfds=["imdb_reviews:train"],
            tfds_data_dir=str(tmp_path / "tfds"),
            inputs=None,
            val_fraction=0.0,
            chunk_size=1 << 20,
        )
    assert manifest["inputs"] == ["tfds:imdb_reviews:train"]
    assert manifest["totals"]["documents"] == len(documents)
    tokenizer = Tokenizer.load(str(tmp_path / "out"))
    stream = read_stream(str(tmp_path / "out"), "train", manifest)
    complete, _ = decode_documents(tokenizer, stream)
    assert complete == documents[: len(complete)] and len(complete) >= len(documents) - 2


def test_unigram_tokenizer_and_reusing_a_data_directory(many_files, tmp_path):
    first = run(
        tmp_path / "first",
        many_files["inputs"],
        tokenizer_type="unigram",
        vocabulary_size=300,
        chunk_size=1 << 20,
    )
    assert first["tokenizer"]["model_type"] == "unigram"
    assert first["tokenizer"]["sample_documents"] > 0
    tokenizer = Tokenizer.load(str(tmp_path / "first"))
    text = "tensor shard: naïve 日本 ✓"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # A data directory is a tokenizer directory: the second run reuses it.
    second = run(
        tmp_path / "second", many_files["inputs"], str(tmp_path / "first"), chunk_size=1 << 20
    )
    assert second["tokenizer"]["trained"] is False
    assert second["tokenizer"]["sha256"] == first["tokenizer"]["sha256"]
    assert second["splits"] == first["splits"]


@pytest.mark.slow
def test_wordpiece_tokenizer(many_files, tmp_path):
    manifest = run(
        tmp_path / "out",
        many_files["inputs"],
        tokenizer_type="wordpiece",
        vocabulary_size=200,
        chunk_size=1 << 20,
    )
    description = manifest["tokenizer"]
    assert description["type"] == "wordpiece" and description["model_file"] == "vocab.txt"
    assert (description["pad_id"], description["unk_id"], description["eos_id"]) == (0, 1, 2)
    assert (description["cls_id"], description["sep_id"], description["mask_id"]) == (3, 4, 5)
    tokenizer = Tokenizer.load(str(tmp_path / "out"))
    assert tokenizer.vocabulary_size == description["vocabulary_size"] <= 200
    assert tokenizer.decode(tokenizer.encode("Tensor shard: worker.")) == "tensor shard : worker ."
    stream = np.concatenate(read_records(str(tmp_path / "out"), "train")).tolist()
    assert stream.count(tokenizer.eos_id) >= manifest["splits"]["train"]["documents"] - 2
    assert tokenizer.unk_id not in stream  # The vocabulary spells every training word.


def test_bad_new_arguments(many_files, tmp_path):
    with pytest.raises(
        ValueError, match=r"`tokenizer_type` must be one of .*Received: tokenizer_type='bpe2'"
    ):
        run(tmp_path / "a", many_files["inputs"], tokenizer_type="bpe2")
    with pytest.raises(ValueError, match=r"`workers` must be a positive int. Received: workers=0"):
        run(tmp_path / "b", many_files["inputs"], workers=0)
    with pytest.raises(
        ValueError, match=r"`vocabulary_size` must be an int of at least 263 for --format encoder"
    ):
        run(tmp_path / "c", many_files["inputs"], record_format="encoder", vocabulary_size=261)
    with pytest.raises(DataError, match=r"cannot load the TFDS split"):
        run(
            tmp_path / "d",
            [],
            inputs=None,
            tfds=["no_such_dataset_xyz"],
            tfds_data_dir=str(tmp_path),
        )
