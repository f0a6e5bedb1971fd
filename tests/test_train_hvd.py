"""train_hvd.py end to end: real data pipeline, real horovodrun, two ranks."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import REPO, checkpoint_tensors, horovodrun, launch_until_killed, run

TINY_MODEL = [
    "--num-layers", "2", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]


@pytest.mark.distributed
def test_two_ranks_read_different_data_learn_and_end_identical(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    flags = [
        "--data", tiny_data, "--out", run_dir, "--steps", "60", "--batch-size", "4",
        "--learning-rate", "3e-3", "--warmup-steps", "5", "--log-every", "5",
        "--eval-batches", "0", *TINY_MODEL,
    ]
    script = REPO / "tests" / "hvd_scripts" / "train_and_dump.py"
    code, output = horovodrun(2, script, tmp_path, *flags)
    assert code == 0, output
    assert "warning: --warmup-steps" not in output  # 5 warmup steps of 60
    ranks = [np.load(tmp_path / f"rank-{rank}.npz") for rank in (0, 1)]
    assert not np.array_equal(ranks[0]["first_inputs"], ranks[1]["first_inputs"])
    weights = [key for key in ranks[0] if key.startswith("weight_")]
    assert len(weights) == 2 + 2 * 12 + 2  # embeddings, 2 blocks, final norm
    for key in weights:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)

    # Only rank 0 logs and writes; the loss fell well below the unigram baseline.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r["split"] == "train"]
    assert len(train_losses) == 1 + 60 // 5
    assert train_losses[-1] < 0.6 * train_losses[0]
    validation = [r for r in records if r["split"] == "val"][-1]
    assert validation["loss"] < validation["unigram_entropy"] - 0.5
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["hidden_dim"] == 32 and config["workers"] == 2
    assert config["model"]["vocabulary_size"] == 300
    assert (run_dir / "tokenizer.model").exists()
    assert (run_dir / "ckpt-60" / "index.json").exists()
    assert list((run_dir / "tensorboard").iterdir())


@pytest.mark.distributed
def test_fp16_allreduce_keeps_ranks_identical(tiny_data, tmp_path):
    flags = ["--data", tiny_data, "--out", tmp_path / "run", "--steps", "6", "--batch-size", "4",
             "--log-every", "3", "--eval-batches", "1", "--peak-flops", "1e10",
             "--fp16-allreduce", *TINY_MODEL]
    code, output = horovodrun(2, REPO / "tests" / "hvd_scripts" / "train_and_dump.py",
                              tmp_path, *flags)
    assert code == 0, output
    ranks = [np.load(tmp_path / f"rank-{rank}.npz") for rank in (0, 1)]
    weights = [key for key in ranks[0] if key.startswith("weight_")]
    for key in weights:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    losses = _train_losses(tmp_path / "run")
    assert losses[6] < losses[1]
    # config.json records the Horovod front end's options beside TrainConfig's.
    train = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert train["fp16_allreduce"] is True and train["allreduce_bucket_mb"] == 3.0
    assert "strategy" not in train


@pytest.mark.distributed
def test_train_hvd_and_tfgpt_train_resume_and_refuse_to_overwrite(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--data", tiny_data, "--out", run_dir, "--batch-size", "4", "--log-every", "2",
             "--eval-batches", "2", *TINY_MODEL]
    code, output = horovodrun(2, REPO / "train_hvd.py", *flags, "--steps", "4",
                              "--save-every", "2")
    assert code == 0, output
    assert "validation loss" in output
    # The default 100 warmup steps outlast the run: said once, by rank 0 only.
    assert output.count("warning: --warmup-steps gives 100 warmup steps for a run of 4") == 1
    # `tfgpt train` is the same front end: the console script (setup.py) ...
    code, output = run([Path(sys.executable).parent / "tfgpt", "train", *flags, "--steps", "4"])
    assert code == 2 and "pass --resume" in output, output
    # ... and `python -m tfgpt train` under horovodrun.
    code, output = horovodrun(2, "-m", "tfgpt", "train", *flags, "--steps", "6", "--resume")
    assert code == 0, output
    assert "resumed from" in output and "ckpt-4" in output
    assert (run_dir / "ckpt-6" / "index.json").exists()


def test_bad_data_directory_is_one_error_line(tmp_path):
    code, output = run([sys.executable, REPO / "train_hvd.py",
                        "--data", tmp_path / "missing", "--steps", "2"])
    assert code == 2
    assert "error: no manifest.json" in output
    assert "Traceback" not in output


def test_vocabulary_smaller_than_tokenizer_is_rejected(tiny_data, tmp_path):
    code, output = run([sys.executable, REPO / "train_hvd.py",
                        "--data", tiny_data, "--out", tmp_path / "run", "--steps", "2",
                        "--vocabulary-size", "100", *TINY_MODEL])
    assert code == 2
    assert "vocabulary_size=100" in output and "300 ids" in output


def _corrupted_copy(tiny_data, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = sorted(data.glob("train-*.tfrecord"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)  # same size, flipped bytes
    shard.write_bytes(bytes(raw))
    return data, shard


def _train_locally(argv):
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.flags import parse_flags
    from tfgpt.training.trainer import train

    train_config, overrides = parse_flags(argv)
    return train(train_config, overrides, LocalDistribution())


def test_corrupted_shard_stops_training_with_its_name(tiny_data, tmp_path):
    data, shard = _corrupted_copy(tiny_data, tmp_path)
    with pytest.raises(ValueError, match=rf"{shard.name}: shard is corrupted: sha256"):
        _train_locally(["--data", str(data), "--out", str(tmp_path / "run"), "--steps", "200",
                        "--batch-size", "4", *TINY_MODEL])


def test_skip_corrupt_trains_on_without_the_bad_shard(tiny_data, tmp_path):
    from pipelines.reader import CorruptShardWarning

    data, shard = _corrupted_copy(tiny_data, tmp_path)
    with pytest.warns(CorruptShardWarning, match=shard.name):
        model, metrics = _train_locally([
            "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "30",
            "--batch-size", "4", "--skip-corrupt", "--eval-batches", "2", "--peak-flops", "1e10",
            *TINY_MODEL])
    assert np.isfinite(metrics["val_loss"])


def _train_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.mark.distributed
@pytest.mark.parametrize("workers, elastic", [(1, False), (2, False), (2, True)])
def test_sigkill_and_resume_equals_an_uninterrupted_run(tiny_data, tmp_path, workers, elastic):
    """2N steps in one go == N steps, SIGKILL, resume for N more: bitwise.

    `elastic`: the `--elastic` run under plain horovodrun (no discovery
    script), whose data position is its cursor in the global order.
    """
    def command(run_dir, *extra):
        flags = [REPO / "train_hvd.py", "--data", tiny_data, "--out", run_dir,
                 "--steps", "12", "--save-every", "6", "--log-every", "2",
                 "--batch-size", "4", "--dropout", "0.1", "--eval-batches", "1",
                 "--peak-flops", "1e11", *TINY_MODEL, *extra]
        return flags + (["--elastic", "--commit-every", "4"] if elastic else [])

    def launch(*flags):
        if workers == 1:
            return run([sys.executable, *flags])
        return horovodrun(2, *flags)

    # The straight run, then the killed one, in one launch: the kill ends it.
    code, output = launch_until_killed(REPO / "train_hvd.py", workers, [
        command(tmp_path / "straight")[1:],
        {"argv": command(tmp_path / "killed")[1:], "env": {"TFGPT_FAULT_KILL_AFTER_SAVE": "6"}}])
    assert (tmp_path / "straight" / "ckpt-12" / "index.json").exists(), output
    assert elastic == ("warning: --elastic outside an elastic horovodrun" in output)
    assert code != 0 and not (tmp_path / "killed" / "ckpt-12" / "index.json").exists(), output
    assert (tmp_path / "killed" / "ckpt-6" / "index.json").exists()
    code, output = launch(*command(tmp_path / "killed", "--resume"))
    assert code == 0, output
    assert "resumed from" in output
    assert ("at step 6, data position 48 of the global order" if elastic
            else "next unseen batch") in output

    straight = checkpoint_tensors(tmp_path / "straight" / "ckpt-12")
    resumed = checkpoint_tensors(tmp_path / "killed" / "ckpt-12")
    assert straight.keys() == resumed.keys()
    assert any("optimizer" in name for name in straight)
    for name in straight:
        np.testing.assert_array_equal(straight[name], resumed[name], err_msg=name)
    straight_losses = _train_losses(tmp_path / "straight")
    resumed_losses = _train_losses(tmp_path / "killed")
    for at_step in (8, 10, 12):
        assert resumed_losses[at_step] == straight_losses[at_step], at_step
