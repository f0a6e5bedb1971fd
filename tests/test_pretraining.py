"""Encoder pretraining through the trainer core: --task mlm, mlm+nsp, mlm+sop."""

import json
import sys

import numpy as np
import pytest

from tests.launch import REPO, horovodrun, run
from tests.synthetic import pattern_corpus, prepared, repeated_letter_corpus

TINY_ALBERT = ["--preset", "albert-demo", "--num-layers", "2", "--hidden-dim", "64",
               "--num-heads", "4", "--intermediate-dim", "128", "--embedding-dim", "32",
               "--max-sequence-length", "32"]
TINY_BERT = ["--preset", "bert-demo", "--num-layers", "2", "--hidden-dim", "32",
             "--num-heads", "2", "--intermediate-dim", "48", "--max-sequence-length", "32"]


@pytest.fixture(scope="module")
def encoder_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoder")
    repeated_letter_corpus(root / "corpus.txt")
    return prepared(root / "corpus.txt", root / "data", "--format", "encoder", "--seq-len", "32",
                    "--vocab-size", "300", "--val-fraction", "0.1")


def _train(argv):
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.trainer import train

    train_config, overrides = parse_flags(argv)
    return train(train_config, overrides, LocalDistribution())


@pytest.mark.slow
def test_tiny_albert_learns_masked_tokens_within_a_cpu_minute(encoder_data, tmp_path):
    model, metrics = _train([
        "--data", str(encoder_data), "--out", str(tmp_path), *TINY_ALBERT, "--task", "mlm+sop",
        "--steps", "800", "--batch-size", "32", "--learning-rate", "3e-3",
        "--warmup-steps", "30", "--weight-decay", "0", "--log-every", "100",
        "--eval-batches", "0", "--peak-flops", "1e10",
    ])
    # About 25 distinct pieces: chance is about 0.04.
    assert metrics["val_mlm_accuracy"] > 0.75, metrics
    assert 0.0 <= metrics["val_sop_accuracy"] <= 1.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["split"] == "train"]
    assert train_records[-1]["mlm_accuracy"] > train_records[0]["mlm_accuracy"] + 0.5
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["family"] == "albert" and config["task"] == "mlm+sop"
    assert config["model"]["embedding_dim"] == 32


def test_tiny_roberta_trains_the_masked_lm_alone(encoder_data, tmp_path):
    # One segment and no pair task; positions skip the data's pad id.
    model, metrics = _train([
        "--data", str(encoder_data), "--out", str(tmp_path), "--preset", "roberta-demo",
        "--num-layers", "2", "--hidden-dim", "32", "--num-heads", "2", "--intermediate-dim", "48",
        "--max-sequence-length", "32", "--steps", "40", "--batch-size", "16",
        "--learning-rate", "3e-3", "--warmup-steps", "5", "--log-every", "20",
        "--eval-batches", "2", "--peak-flops", "1e10",
    ])
    manifest = json.loads((encoder_data / "manifest.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["family"] == "roberta" and config["task"] == "mlm"
    assert config["model"]["pad_id"] == manifest["tokenizer"]["pad_id"] == model.pad_id
    assert config["model"]["num_segments"] == 1
    assert not any(name.startswith(("val_nsp", "val_sop")) for name in metrics), metrics
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["split"] == "train"]
    assert train_records[-1]["mlm_loss"] < train_records[0]["mlm_loss"], train_records


@pytest.mark.distributed
def test_bert_mlm_nsp_under_horovod_keeps_ranks_identical(encoder_data, tmp_path):
    flags = ["--data", encoder_data, "--out", tmp_path / "run", *TINY_BERT, "--task", "mlm+nsp",
             "--steps", "8", "--batch-size", "8", "--log-every", "4", "--eval-batches", "2",
             "--peak-flops", "1e10"]
    script = REPO / "tests" / "hvd_scripts" / "train_and_dump.py"
    code, output = horovodrun(2, script, tmp_path, *flags)
    assert code == 0, output
    assert "nsp accuracy" in output
    ranks = [np.load(tmp_path / f"rank-{rank}.npz") for rank in (0, 1)]
    assert not np.array_equal(ranks[0]["first_inputs"], ranks[1]["first_inputs"])
    weights = [key for key in ranks[0] if key.startswith("weight_")]
    assert len(weights) > 20
    for key in weights:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "bert-demo", "--task", "clm"], "--task clm does not train a bert model"),
        (["--preset", "bert-demo", "--task", "mlm+sop"], "takes --task mlm+nsp or mlm"),
        (["--preset", "gpt-demo", "--embedding-dim", "8"], "--embedding-dim is not a GPTConfig field"),
        (["--preset", "albert-demo", "--tie-embeddings"], "--tie-embeddings is not a AlbertConfig field"),
    ],
)
def test_task_and_family_mismatches_are_flag_errors(flags, message, tmp_path):
    code, output = run([sys.executable, REPO / "train_hvd.py", "--data", tmp_path, *flags])
    assert code == 2 and message in output, output


def test_masked_lm_on_packed_data_names_the_format(tmp_path):
    pattern_corpus(tmp_path / "corpus.txt", documents=100)
    prepared(tmp_path / "corpus.txt", tmp_path / "d", "--seq-len", "16", "--vocab-size", "300")
    with pytest.raises(ValueError, match=r"--task mlm\+sop reads 'tfgpt-encoder-segments'.*--format encoder"):
        _train(["--data", str(tmp_path / "d"), "--out", str(tmp_path / "run"), *TINY_ALBERT])
