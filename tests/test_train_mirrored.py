"""train_mirrored.py, and the same numbers from every front end."""

import json
import sys

import numpy as np
import pytest

from tests.launch import (
    REPO,
    assert_same_train_losses,
    checkpoint_tensors,
    horovodrun,
    multi_worker,
    run,
    train_losses,
)
from tests.synthetic import pattern_corpus, prepared
from tests.test_train_hvd import TINY_MODEL

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def one_file_data(tmp_path_factory):
    """One shard: two workers then split it by record, so an unshuffled
    global batch holds the same sequences whatever the front end."""
    root = tmp_path_factory.mktemp("data")
    pattern_corpus(root / "corpus.txt")
    return prepared(root / "corpus.txt", root / "prepared", "--seq-len", "16",
                    "--vocab-size", "300", "--val-fraction", "0.1")


def _flags(data, out, batch_size, *extra):
    return ["--data", data, "--out", out, "--steps", "6", "--log-every", "1",
            "--batch-size", batch_size, "--learning-rate", "3e-3", "--warmup-steps", "0",
            "--no-shuffle", "--no-scale-learning-rate", "--eval-batches", "2",
            "--peak-flops", "1e11", *TINY_MODEL, *extra]


def test_single_process_horovod_and_mirrored_give_the_same_losses(one_file_data, tmp_path):
    """Global batch 8: 1 process x 8, 2 Horovod ranks x 4, 2 mirrored replicas x 4."""
    code, output = run([sys.executable, REPO / "train_hvd.py",
                        *_flags(one_file_data, tmp_path / "single", 8)])
    assert code == 0, output
    code, output = horovodrun(2, REPO / "train_hvd.py", *_flags(one_file_data, tmp_path / "hvd", 4))
    assert code == 0, output
    code, output = run([sys.executable, REPO / "train_mirrored.py", "--strategy", "mirrored",
                        "--logical-cpus", "2", *_flags(one_file_data, tmp_path / "mirrored", 4)])
    assert code == 0, output
    assert "2 replica(s)" in output
    # config.json records the tf.distribute front end's options, not Horovod's.
    train = json.loads((tmp_path / "mirrored" / "config.json").read_text())["train"]
    assert train["strategy"] == "mirrored" and train["logical_cpus"] == 2
    assert "fp16_allreduce" not in train and "allreduce_bucket_mb" not in train
    # Float32 sums in another order: agreement to 1e-4 over 6 updates.
    single = assert_same_train_losses(
        tmp_path / "single", [tmp_path / "hvd", tmp_path / "mirrored"], steps=6, tolerance=1e-4)
    assert single[6] < single[1] - 0.1  # the steps did something


def test_two_multi_worker_mirrored_workers_end_with_identical_weights(one_file_data, tmp_path):
    script = REPO / "tests" / "worker_scripts" / "mirrored_train_and_dump.py"
    flags = _flags(one_file_data, tmp_path / "run", 4, "--strategy", "multi-worker")
    flags[flags.index("--no-shuffle")] = "--shuffle"
    results = multi_worker(2, script, tmp_path, *flags)
    for code, output in results:
        assert code == 0, output
    outputs = [output for _, output in results]
    workers = [np.load(tmp_path / f"worker-{index}.npz") for index in (0, 1)]
    assert len(workers[0].files) > 10
    for key in workers[0].files:
        np.testing.assert_array_equal(workers[0][key], workers[1][key], err_msg=key)
    losses = train_losses(tmp_path / "run")
    assert losses[6] < losses[1]
    assert "2 worker(s), 2 replica(s)" in outputs[0]
    # Only the chief keeps checkpoints; the other worker's scratch copy is gone.
    assert (tmp_path / "run" / "ckpt-6" / "index.json").exists()
    assert not list((tmp_path / "run").glob(".worker-*"))


def test_mirrored_sigkill_and_resume_equals_an_uninterrupted_run(one_file_data, tmp_path):
    def command(run_dir, *extra):
        flags = _flags(one_file_data, run_dir, 4, "--save-every", "3", *extra)
        flags[flags.index("--no-shuffle")] = "--shuffle"
        flags[flags.index("--log-every") + 1] = "1"
        return [sys.executable, REPO / "train_mirrored.py", "--strategy", "mirrored",
                "--logical-cpus", "2", *flags]

    code, output = run(command(tmp_path / "straight"))
    assert code == 0, output
    code, output = run(command(tmp_path / "killed"), env={"TFGPT_FAULT_KILL_AFTER_SAVE": "3"})
    assert code != 0 and (tmp_path / "killed" / "ckpt-3" / "index.json").exists(), output
    code, output = run(command(tmp_path / "killed", "--resume"))
    assert code == 0, output
    assert "next unseen batch (replayed)" in output
    straight = checkpoint_tensors(tmp_path / "straight" / "ckpt-6")
    resumed = checkpoint_tensors(tmp_path / "killed" / "ckpt-6")
    assert straight.keys() == resumed.keys()
    for name in straight:
        np.testing.assert_array_equal(straight[name], resumed[name], err_msg=name)
    assert train_losses(tmp_path / "killed")[6] == train_losses(tmp_path / "straight")[6]


@pytest.mark.parametrize("flag", [["--fp16-allreduce"], ["--allreduce-bucket-mb", "0"]])
def test_horovod_options_are_refused_by_the_mirrored_front_end(one_file_data, tmp_path, flag):
    # Horovod's flags are the Horovod front ends' alone: refused here, with
    # the front ends that take them, before TensorFlow starts
    # (tests/test_flags.py for the rest).
    code, output = run([sys.executable, REPO / "train_mirrored.py", *flag,
                        *_flags(one_file_data, tmp_path / "run", 4)])
    assert code == 2, output
    assert f"error: {flag[0]} is a flag of train_hvd.py and finetune_hvd.py" in output
    assert not (tmp_path / "run").exists()
