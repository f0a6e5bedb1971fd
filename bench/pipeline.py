"""Data pipeline throughput: preparation against a Hugging Face reference, and the reader.

Usage:
    python bench/pipeline.py                          # 32 MB corpus, 8000-piece BPE
    python bench/pipeline.py --corpus-mb 64 --json /tmp/pipeline.json

All in one run, on one corpus:

1. Corpus: the built-in corpus (`pipelines.default_corpus`, Python's docs,
   about 2 MB of English prose and code) written as JSON Lines and repeated
   with a numbered header per copy until `--corpus-mb` MB of text.
2. Tokenizer: a SentencePiece BPE model of `--vocab-size` pieces trained on
   the corpus (not timed in the comparison).
3. Preparation: `python -m pipelines.prepare --tokenizer ... --workers W
   --num-threads 1` for W = 1 and 2 (W processes, one encoding thread each), each a fresh process, timed from start to exit
   (interpreter start, scan pass, encoding, TFRecord writing with
   checksums and fsync, commit). Reported as MB/s of raw text, and per core
   (divided by W). Best of `--repeats` rounds, interleaved with step 4.
4. Reference: a fresh process that reads the same JSON Lines, tokenizes the
   text with the Hugging Face `tokenizers` library using the same vocabulary
   and merges (converted from the SentencePiece model: same pieces, byte
   fallback, Metaspace pre-tokenizer without a prefix space, single digits)
   in batches of 1024 documents, appends EOS and writes the int32 ids with
   NumPy; `RAYON_NUM_THREADS=W` for W = 1 and 2. The share of documents
   whose ids are identical to SentencePiece's is reported too (the two
   segment runs of spaces differently, so not every document agrees).
5. Reader: `pipelines.reader.make_dataset(..., batch_size=8)` over the
   prepared data (seq_len 256) drained by a no-op consumer for
   `--reader-seconds` after 20 warm-up batches, with 1 worker, then 2
   workers (two processes, `num_shards=2`, running at once; their rates
   add up). Tokens/s = batches x 8 x 256 / seconds.
6. Training consumption: `tfgpt.GPT.from_preset("gpt-mini")` trained by
   `TrainStep(model, optimizer, LocalDistribution())` on 8 x 256 batches:
   3 untimed steps (tracing), then `--train-steps` timed. The reader must
   deliver at least 20x the tokens/s a step consumes.

Prints a table and writes every figure to `--json`. The machine is shared:
figures vary by tens of percent between runs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPOSITORY)

SEQ_LEN = 256
READER_BATCH = 8


def write_corpus(path, megabytes):
    """The default corpus as JSON Lines, repeated to `megabytes` MB of text."""
    from pipelines import default_corpus

    documents = [document for document in default_corpus.iter_documents() if document.strip()]
    written = 0
    copy = 0
    with open(path, "w", encoding="utf-8") as output_file:
        while written < megabytes * 1e6:
            for index, document in enumerate(documents):
                text = f"[copy {copy}, document {index}]\n{document}"
                output_file.write(json.dumps({"text": text}) + "\n")
                written += len(text.encode("utf-8"))
                if written >= megabytes * 1e6:
                    break
            copy += 1
    return written


def huggingface_tokenizer(model_proto, path):
    """The SentencePiece BPE model as a `tokenizers.Tokenizer`, saved to `path`."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(model_proto)
    vocabulary = {piece.piece: index for index, piece in enumerate(model.pieces)}
    normal = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
    # Merges in SentencePiece's order: a piece's id is its merge rank.
    ranked = []
    for piece, index in vocabulary.items():
        if model.pieces[index].type != normal or len(piece) < 2:
            continue
        for split in range(1, len(piece)):
            left, right = piece[:split], piece[split:]
            if left in vocabulary and right in vocabulary:
                ranked.append((index, vocabulary[left], vocabulary[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    tokenizer = Tokenizer(
        models.BPE(vocabulary, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    tokenizer.save(path)
    return tokenizer


REFERENCE_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from tokenizers import Tokenizer
    tokenizer_path, corpus_path, output_path, eos_id = sys.argv[1:5]
    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = np.array([int(eos_id)], np.int32)
    with open(corpus_path, encoding="utf-8") as corpus, open(output_path, "wb") as output:
        batch = []
        def flush():
            encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
            ids = np.concatenate(
                [part for e in encodings for part in (np.asarray(e.ids, np.int32), eos)]
            )
            ids.tofile(output)
            batch.clear()
        for line in corpus:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1024:
                flush()
        if batch:
            flush()
    """)

READER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pipelines import reader
    data_dir, workers, index, seconds, batch_size = sys.argv[1:6]
    dataset = reader.make_dataset(data_dir, "train", int(batch_size), num_shards=int(workers),
                                  shard_index=int(index))
    iterator = iter(dataset)
    for _ in range(20):
        inputs, _ = next(iterator)
    sequence_length = int(inputs.shape[1])
    batches = 0
    start = time.perf_counter()
    while time.perf_counter() - start < float(seconds):
        next(iterator)
        batches += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"tokens_per_second": batches * int(batch_size) * sequence_length / elapsed,
                      "batches": batches, "seconds": elapsed}))
    """)


def timed(argv, environment=None):
    start = time.perf_counter()
    completed = subprocess.run(
        argv, cwd=REPOSITORY, capture_output=True, text=True, env=environment
    )
    seconds = time.perf_counter() - start
    if completed.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed:\n{completed.stderr[-3000:]}")
    return seconds, completed


def record(table, workers, seconds, text_bytes, tokens):
    """Keep the fastest of the rounds for `workers`, with every round's seconds."""
    entry = table.setdefault(workers, {"rounds_seconds": []})
    entry["rounds_seconds"].append(seconds)
    best = min(entry["rounds_seconds"])
    entry.update(
        seconds=best,
        megabytes_per_second=text_bytes / 1e6 / best,
        megabytes_per_second_per_core=text_bytes / 1e6 / best / workers,
        tokens=tokens,
    )


def measure_training(steps):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfgpt
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.train_step import TrainStep

    model = tfgpt.GPT.from_preset("gpt-mini")
    optimizer = keras.optimizers.AdamW(learning_rate=1e-4)
    optimizer.build(model.trainable_variables)
    step = TrainStep(model, optimizer, LocalDistribution())
    generator = np.random.default_rng(0)
    vocabulary_size = model.get_config()["vocabulary_size"]
    tokens = generator.integers(0, vocabulary_size, size=(READER_BATCH, SEQ_LEN + 1))
    inputs = tf.constant(tokens[:, :-1], tf.int32)
    targets = tf.constant(tokens[:, 1:], tf.int32)
    for _ in range(3):
        step(inputs, targets)
    start = time.perf_counter()
    for _ in range(steps):
        result = step(inputs, targets)
    float(result["loss"])  # Wait for the last step.
    seconds = time.perf_counter() - start
    return {
        "steps": steps,
        "seconds_per_step": seconds / steps,
        "tokens_per_second": steps * READER_BATCH * SEQ_LEN / seconds,
    }


def main():
    from tfgpt.cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="python bench/pipeline.py", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--corpus-mb", type=float, default=32.0, metavar="MB",
        help="size of the corpus (the built-in corpus repeated) in MB of text",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=8000, help="pieces of the SentencePiece BPE model"
    )
    parser.add_argument(
        "--reader-seconds", type=float, default=10.0, metavar="SECONDS",
        help="how long the reader is drained, after its warm-up batches",
    )
    parser.add_argument(
        "--train-steps", type=int, default=10, metavar="N",
        help="timed gpt-mini training steps (after 3 untimed ones)",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="preparation rounds; the best counts"
    )
    parser.add_argument(
        "--workdir", metavar="DIR",
        help="keep the corpus and outputs here; unset: a temporary directory",
    )
    parser.add_argument(
        "--json", default=os.path.join(tempfile.gettempdir(), "tfgpt_pipeline_bench.json"),
        metavar="FILE", help="file to write every figure to",
    )
    arguments = parser.parse_args()

    from pipelines.tokenizer import train_tokenizer

    workdir = arguments.workdir or tempfile.mkdtemp(prefix="tfgpt_pipeline_bench_")
    os.makedirs(workdir, exist_ok=True)
    corpus = os.path.join(workdir, "corpus.jsonl")
    text_bytes = write_corpus(corpus, arguments.corpus_mb)
    results = {
        "corpus_bytes": text_bytes,
        "vocabulary_size": arguments.vocab_size,
        "seq_len": SEQ_LEN,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(f"corpus: {text_bytes / 1e6:.1f} MB of text in {corpus}", flush=True)

    # Tokenizer (shared by both sides).
    from pipelines import default_corpus

    start = time.perf_counter()
    sample = [document for document in default_corpus.iter_documents() if document.strip()]
    model_path = os.path.join(workdir, "tokenizer.model")
    tokenizer = train_tokenizer(sample, arguments.vocab_size, model_path)
    results["tokenizer_training_seconds"] = time.perf_counter() - start
    hf_path = os.path.join(workdir, "tokenizer.json")
    hf_tokenizer = huggingface_tokenizer(tokenizer.model_proto, hf_path)
    check = sample[:2000]
    spm_ids = tokenizer.encode_batch(check)
    hf_ids = [
        encoding.ids for encoding in hf_tokenizer.encode_batch(check, add_special_tokens=False)
    ]
    results["reference_identical_documents"] = sum(a == b for a, b in zip(spm_ids, hf_ids)) / len(
        check
    )
    results["reference_tokens_ratio"] = sum(map(len, hf_ids)) / sum(map(len, spm_ids))

    # Preparation, both sides, 1 and 2 cores, interleaved so that a busy spell
    # of the shared machine hits both; the best of `--repeats` rounds counts.
    results["prepare"] = {}
    results["reference"] = {}
    for round_index in range(arguments.repeats):
        for workers in (1, 2):
            output = os.path.join(workdir, f"data-{workers}")
            seconds, _ = timed(
                [
                    sys.executable,
                    "-m",
                    "pipelines.prepare",
                    "--input",
                    corpus,
                    "--output",
                    output,
                    "--seq-len",
                    str(SEQ_LEN),
                    "--tokenizer",
                    model_path,
                    "--workers",
                    str(workers),
                    "--num-threads",  # One SentencePiece thread per worker: W cores.
                    "1",
                    "--shard-size",
                    "64M",
                    "--chunk-size",
                    "8M",
                    "--overwrite",
                ]
            )
            with open(os.path.join(output, "manifest.json")) as manifest_file:
                tokens = json.load(manifest_file)["totals"]["tokens"]
            record(results["prepare"], workers, seconds, text_bytes, tokens)
            print(
                f"round {round_index + 1}: prepare --workers {workers}: {seconds:.1f} s", flush=True
            )
            environment = dict(
                os.environ, RAYON_NUM_THREADS=str(workers), TOKENIZERS_PARALLELISM="true"
            )
            ids_path = os.path.join(workdir, f"reference-{workers}.int32")
            seconds, _ = timed(
                [
                    sys.executable,
                    "-c",
                    REFERENCE_SCRIPT,
                    hf_path,
                    corpus,
                    ids_path,
                    str(tokenizer.eos_id),
                ],
                environment,
            )
            record(
                results["reference"], workers, seconds, text_bytes, os.path.getsize(ids_path) // 4
            )
            print(
                f"round {round_index + 1}: reference, {workers} thread(s): {seconds:.1f} s",
                flush=True,
            )

    # Reader.
    data_dir = os.path.join(workdir, "data-1")
    results["reader"] = {}
    for workers in (1, 2):
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    READER_SCRIPT,
                    data_dir,
                    str(workers),
                    str(index),
                    str(arguments.reader_seconds),
                    str(READER_BATCH),
                ],
                cwd=REPOSITORY,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for index in range(workers)
        ]
        rates = []
        for process in processes:
            stdout, stderr = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"reader failed:\n{stderr[-3000:]}")
            rates.append(json.loads(stdout.strip().splitlines()[-1])["tokens_per_second"])
        results["reader"][workers] = {"tokens_per_second": sum(rates), "per_worker": rates}
        print(f"reader, {workers} worker(s): {sum(rates):,.0f} tokens/s", flush=True)

    # Training consumption.
    results["training"] = measure_training(arguments.train_steps)
    consumption = results["training"]["tokens_per_second"]
    for workers in (1, 2):
        results["reader"][workers]["times_training_consumption"] = (
            results["reader"][workers]["tokens_per_second"] / consumption
        )

    print()
    print("| measure | 1 core | 2 cores |")
    print("| --- | ---: | ---: |")
    for name, key in (("tfgpt prepare", "prepare"), ("HF tokenizers + NumPy", "reference")):
        cells = [
            f"{results[key][w]['megabytes_per_second']:.2f} MB/s "
            f"({results[key][w]['megabytes_per_second_per_core']:.2f}/core)"
            for w in (1, 2)
        ]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    cells = [
        f"{results['reader'][w]['tokens_per_second']:,.0f} tok/s "
        f"({results['reader'][w]['times_training_consumption']:.0f}x gpt-mini)"
        for w in (1, 2)
    ]
    print(f"| reader, no-op consumer | {cells[0]} | {cells[1]} |")
    print(
        f"\ngpt-mini training step (8 x {SEQ_LEN}): "
        f"{results['training']['seconds_per_step'] * 1e3:.0f} ms, "
        f"{consumption:,.0f} tokens/s; reference ids identical on "
        f"{results['reference_identical_documents']:.0%} of documents, "
        f"{results['reference_tokens_ratio']:.3f}x the tokens"
    )
    with open(arguments.json, "w") as json_file:
        json.dump(results, json_file, indent=2)
    print(f"wrote {arguments.json}")


if __name__ == "__main__":
    main()
