"""Fixtures shared by the training tests."""

import os

import pytest

from tests.synthetic import pattern_corpus


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Packed records (seq_len 16, vocabulary 300) of `pattern_corpus`, in
    several shards of 8 KiB so that two workers shard by file."""
    from pipelines import prepare

    root = tmp_path_factory.mktemp("data")
    pattern_corpus(root / "corpus.txt")
    out = root / "prepared"
    code = prepare.main([
        "--input", str(root / "corpus.txt"), "--output", str(out),
        "--seq-len", "16", "--vocab-size", "300", "--shard-size", "8K",
        "--val-fraction", "0.1",
    ])
    assert code == 0
    return out


@pytest.fixture(scope="session", autouse=True)
def machine_cache(tmp_path_factory):
    """The suite's own `TFGPT_CACHE_DIR` (the measured matmul peak): the
    runs it starts share one measurement, and the user's cache is untouched."""
    directory = tmp_path_factory.mktemp("cache")
    previous = os.environ.get("TFGPT_CACHE_DIR")
    os.environ["TFGPT_CACHE_DIR"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("TFGPT_CACHE_DIR", None)
    else:
        os.environ["TFGPT_CACHE_DIR"] = previous
