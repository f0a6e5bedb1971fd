"""train_hvd.py --pipeline-parallel end to end: flags, refusals, checkpoints, resume."""

import os
import shutil
import sys

import pytest

from tests.launch import REPO, horovodrun, run, train_losses, validation_loss
from tfgpt.config.distribution import HorovodOptions

TINY_MODEL = [
    "--num-layers", "3", "--num-heads", "2", "--hidden-dim", "32",
    "--intermediate-dim", "48", "--max-sequence-length", "16",
]
PIPELINE = ["--pipeline-parallel", "2", "--microbatches", "2", "--batch-size", "4"]


@pytest.mark.parametrize("options, message", [
    (dict(pipeline_parallel=2, microbatches=3, pipeline_schedule="interleaved",
          virtual_stages=2), r"--microbatches must be divisible by it.*microbatches=3"),
    (dict(pipeline_parallel=2, virtual_stages=2), r"--virtual-stages is for --pipeline-sch"),
    (dict(microbatches=4), r"need --pipeline-parallel of at least 2.*microbatches=4"),
    (dict(pipeline_parallel=2, zero_stage=2),
     r"use --zero-stage 1.*zero_stage=2, pipeline_parallel=2"),
    (dict(pipeline_parallel=0), r"`pipeline_parallel` must be a positive integer"),
    (dict(pipeline_parallel=2, pipeline_partition="random"), r"pipeline_partition='random'"),
])
def test_options_refuse_sizes_that_do_not_fit(options, message):
    with pytest.raises(ValueError, match=message):
        HorovodOptions(**options)


def test_a_batch_the_micro_batches_do_not_divide_is_refused():
    # (What a pipeline does not combine with: tests/test_refusals.py.)
    from tfgpt.config.models import GPTConfig
    from tfgpt.config.training import TrainConfig
    from tfgpt.training.pipeline_run import check_pipeline_sizes

    options = HorovodOptions(pipeline_parallel=2, microbatches=4)
    with pytest.raises(ValueError, match=r"batch_size=6, microbatches=4"):
        check_pipeline_sizes(TrainConfig(data="d", batch_size=6), options, GPTConfig(num_layers=2))
    check_pipeline_sizes(TrainConfig(data="d", batch_size=8), options,
                         GPTConfig(num_layers=2))  # what fits passes


@pytest.mark.parametrize("microbatches", ["1", "3"])  # M < P, M not divisible by P
def test_bad_pipeline_flags_are_one_error_line_before_tensorflow(capsys, microbatches):
    # (gpipe and 1f1b train at these M: tests/test_pipeline.py.)
    import train_hvd

    with pytest.raises(SystemExit) as exit_info:
        train_hvd.main(["--data", "d", "--pipeline-parallel", "2", "--microbatches", microbatches,
                        "--pipeline-schedule", "interleaved", "--virtual-stages", "2"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert len([line for line in error.splitlines() if "error:" in line]) == 1
    assert f"microbatches={microbatches}, pipeline_parallel=2" in error


def test_train_mirrored_refuses_pipeline_flags_naming_train_hvd(capsys):
    import train_mirrored

    with pytest.raises(SystemExit):
        train_mirrored.main(["--data", "d", "--pipeline-parallel", "2"])
    assert ("error: --pipeline-parallel is a flag of train_hvd.py and finetune_hvd.py"
            in capsys.readouterr().err)



def test_pipeline_runs_lower_the_horovod_cycle_time_unless_it_is_set():
    script = (
        "import os\n"
        "from tfgpt.config.distribution import HorovodOptions\n"
        "from tfgpt.parallel.horovod_bridge import HorovodDistribution\n"
        "try:\n"
        "    HorovodDistribution.create(HorovodOptions(pipeline_parallel=2))\n"
        "except ValueError as error:\n"
        "    print('refused:', error)\n"
        "print('cycle', os.environ['HOROVOD_CYCLE_TIME'])\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "HOROVOD_CYCLE_TIME"}
    for given, expected in [(None, "1"), ("5", "5")]:
        env = dict(environment, **({"HOROVOD_CYCLE_TIME": given} if given else {}))
        code, output = run([sys.executable, "-c", script], env=env)
        assert code == 0, output
        assert f"cycle {expected}" in output
        # One worker cannot hold two stages: data x tensor x pipeline = workers.
        assert "refused: The number of ranks must be data x pipeline x tensor" in output
        assert "size=1, tensor_parallel=1, pipeline_parallel=2" in output


def _train_hvd(workers, data, out, *flags, env=None):
    command = [REPO / "train_hvd.py", "--data", data, "--out", out, "--log-every", "1",
               "--eval-batches", "2", "--warmup-steps", "2", *TINY_MODEL, *flags]
    if workers == 1:
        return run([sys.executable, *command], env=env)
    return horovodrun(workers, *command, env=env)


def _one_error_line_before_the_model(code, output, message):
    assert code != 0
    errors = [line for line in output.splitlines() if "error:" in line and message in line]
    assert errors, output
    # The ranks' lines (horovodrun adds its own traceback when a rank fails).
    ranks = [line for line in output.splitlines() if line.startswith(("[0]", "[1]", "[2]"))]
    assert not any("Traceback" in line or ">:model: " in line for line in ranks), output


@pytest.mark.distributed
def test_more_stages_than_blocks_is_one_error_line(tiny_data, tmp_path):
    code, output = _train_hvd(2, tiny_data, tmp_path / "run", "--steps", "2", *PIPELINE,
                              "--num-layers", "1")
    _one_error_line_before_the_model(
        code, output, "must not exceed the model's --num-layers: each stage needs a block. "
                      "Received: 2 stages, num_layers=1")


@pytest.mark.distributed
@pytest.mark.slow
def test_workers_that_are_not_a_multiple_of_the_stages_is_one_error_line(tiny_data, tmp_path):
    code, output = _train_hvd(3, tiny_data, tmp_path / "run", "--steps", "2", *PIPELINE)
    _one_error_line_before_the_model(code, output, "size=3, tensor_parallel=1, "
                                                   "pipeline_parallel=2")


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_run_resumes_as_uninterrupted_and_its_checkpoint_reads_whole(tiny_data,
                                                                              tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    # (--recompute: each stage recomputes its blocks in the backward passes.)
    flags = [*PIPELINE, "--pipeline-schedule", "gpipe", "--pipeline-partition", "balanced",
             "--recompute"]
    code, output = _train_hvd(2, tiny_data, whole, "--steps", "4", "--save-every", "2", *flags)
    assert code == 0, output
    assert "pipeline: gpipe, 2 stages" in output and "validation loss" in output
    # A copy cut back to its step-2 checkpoint resumes.
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "ckpt-4")
    (cut / "metrics.jsonl").unlink()
    code, output = _train_hvd(2, tiny_data, cut, "--steps", "4", "--resume", *flags)
    assert code == 0, output
    assert "resumed from" in output
    losses, resumed = train_losses(whole), train_losses(cut)
    assert sorted(losses) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert losses[4] < losses[1]
    for step in (3, 4):
        assert resumed[step] == pytest.approx(losses[step], abs=1e-5), step
    # Each stage wrote its blocks: one process reads them as a whole GPT.
    import tensorflow as tf

    from tfgpt.loading import load_model

    model, _ = load_model(str(whole))
    assert model(tf.constant([[1, 2, 3]])).shape == (1, 3, 300)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_sft_and_adapters_train_as_one_process_and_resume_bitwise(tiny_data, tmp_path):
    """PP2 runs of `--task sft` against one process on the same global batches.

    The micro-batches of a batch hold unequal numbers of learned tokens, so
    only the global batch's weighted mean (over its learned tokens, not a
    mean of the micro-batches' means) gives one process's losses and
    weights. With `--lora-rank` each stage trains its blocks' adapters: as
    one process does, its base left bit for bit, its checkpoints holding
    the adapters alone; stopped at step 2 and resumed, the run's checkpoint
    of step 4 is the uninterrupted one's bit for bit; `tfgpt.convert merge`
    folds the adapters in.
    """
    import numpy as np
    import tensorflow as tf

    from pipelines.instruction_data import make_instruction_dataset
    from tests.launch import checkpoint_tensors, launch_each
    from tests.test_instruction_data import WORDS, _prepare, _train
    from tfgpt import convert
    from tfgpt.checkpoint.files import Reader, latest
    from tfgpt.checkpoint.state import model_entries
    from tfgpt.loading import load_model
    from tfgpt.models.adapters import adapter_variables, base_keys

    base = tmp_path / "base"
    common = [*TINY_MODEL, "--dropout", "0.0", "--log-every", "1", "--eval-batches", "1",
              "--warmup-steps", "0", "--schedule", "constant", "--learning-rate", "0.01",
              "--no-shuffle", "--batch-size", "4"]
    _train(["--data", str(tiny_data), "--out", str(base), "--steps", "1", *common])
    # Completions of 1 to 6 words after prompts of 1 or 2: unequal learned tokens per row.
    rng = np.random.default_rng(3)
    code, data = _prepare(tmp_path, tiny_data, [
        {"prompt": " ".join(rng.choice(WORDS, 1 + index % 2)),
         "completion": " ".join(rng.choice(WORDS, 1 + index % 6))} for index in range(60)])
    assert code == 0
    sft = ["--data", str(data), "--task", "sft", "--init", str(base), *common]
    lora = [*sft, "--lora-rank", "2", "--lora-targets", "query_key_value,feedforward_output"]
    pipeline = ["--pipeline-parallel", "2", "--microbatches", "2"]
    one_sft, one_sft_metrics = _train([*sft, "--out", str(tmp_path / "one-sft"), "--steps", "3"])
    one_lora, one_lora_metrics = _train([*lora, "--out", str(tmp_path / "one-lora"),
                                         "--steps", "4"])
    runs = {name: tmp_path / name for name in ("sft", "lora", "resumed")}
    launch_each(REPO / "tests" / "hvd_scripts" / "layout_train.py", 2, [
        [tmp_path, "sft", *sft, "--out", runs["sft"], "--steps", "3", *pipeline,
         "--pipeline-schedule", "gpipe"],
        [tmp_path, "lora", *lora, "--out", runs["lora"], "--steps", "4", "--save-every", "2",
         *pipeline],
        # Stopped after its checkpoint of step 2 (the constant rate does not
        # depend on --steps), then resumed to step 4.
        [tmp_path, "stopped", *lora, "--out", runs["resumed"], "--steps", "2", *pipeline],
        [tmp_path, "resumed", *lora, "--out", runs["resumed"], "--steps", "4", "--resume",
         *pipeline]])

    def held(tag, kind):
        """`{path: array}` of `kind` (weight, frozen) over both stages' files."""
        arrays = {}
        for rank in (0, 1):
            with np.load(tmp_path / f"{tag}-rank-{rank}.npz") as saved:
                arrays.update({key.split("/", 1)[1]: saved[key] for key in saved.files
                               if key.startswith(f"{kind}/")})
        return arrays

    def by_path(variables):
        return {v.path.split("/", 1)[1]: v.numpy() for v in variables}

    # The oracle of step 1: the base model's loss over the learned tokens of
    # the first batch; the mean of its two micro-batches' means is not it.
    inputs, targets, weights = next(iter(make_instruction_dataset(
        str(data), "train", 4, shuffle=False, deterministic=True)))  # as the runs read
    model, _ = load_model(str(base))
    losses = tf.keras.losses.sparse_categorical_crossentropy(
        targets, model(inputs), from_logits=True).numpy()  # (4, T)
    learned = weights.numpy() > 0
    assert learned[:2].sum() != learned[2:].sum()
    mean_of_means = np.mean([losses[rows][learned[rows]].mean() for rows in (slice(0, 2),
                                                                             slice(2, 4))])
    assert abs(mean_of_means - losses[learned].mean()) > 1e-3
    for name in ("sft", "lora"):
        assert train_losses(runs[name])[1] == pytest.approx(losses[learned].mean(), abs=1e-5)

    # Both runs log one process's losses and validation loss; the full fine-tuning
    # (GPipe) ends with its weights.
    for name, metrics, steps in (("sft", one_sft_metrics, 3), ("lora", one_lora_metrics, 4)):
        expected, got = train_losses(tmp_path / f"one-{name}"), train_losses(runs[name])
        assert sorted(got) == list(range(1, steps + 1))
        for step in expected:
            assert got[step] == pytest.approx(expected[step], abs=1e-5), (name, step)
        assert validation_loss(runs[name]) == pytest.approx(metrics["val_loss"], abs=1e-5), name
    trained = held("sft", "weight")
    for path, value in by_path(one_sft.trainable_variables).items():
        np.testing.assert_allclose(trained[path], value, rtol=0, atol=1e-5, err_msg=path)

    # Adapters (1F1B): only they trained, as one process's; the base is the init run's.
    adapters = held("lora", "weight")
    assert set(adapters) == set(by_path(adapter_variables(one_lora)))
    for path, value in by_path(adapter_variables(one_lora)).items():
        np.testing.assert_allclose(adapters[path], value, rtol=0, atol=1e-5, err_msg=path)
    frozen = held("lora", "frozen")
    initial = {path: value for path, value in by_path(model.weights).items()
               if "seed_generator" not in path}
    assert sorted(frozen) == sorted(initial)
    for path, value in frozen.items():
        np.testing.assert_array_equal(value, initial[path], err_msg=path)
    # Its checkpoints hold the adapters (and their moments, the step, the
    # dropout states) and name the base.
    reader = Reader(latest(str(runs["lora"])))
    assert reader.index["base"]["checkpoint"] == latest(str(base))
    ids = {id(v) for v in adapter_variables(one_lora)}
    adapter_keys = {e.key for e in model_entries(one_lora) if id(e.variable) in ids}
    assert adapter_keys <= set(reader.keys) and not set(reader.keys) & base_keys(one_lora)
    assert all(key == "step" or key.startswith(("optimizer/", "rng/"))
               or key.rsplit("/", 1)[0] in adapter_keys
               for key in set(reader.keys) - adapter_keys), sorted(reader.keys)
    # Stopped and resumed: the same state at step 4, bit for bit, and the same losses.
    uninterrupted, resumed = (checkpoint_tensors(run / "ckpt-4")
                              for run in (runs["lora"], runs["resumed"]))
    assert sorted(uninterrupted) == sorted(resumed)
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
    assert train_losses(runs["resumed"]) == train_losses(runs["lora"])
    # Merged: a plain run with one process's adapted logits.
    convert.main(["merge", str(runs["lora"]), str(tmp_path / "merged")])
    plain, _ = load_model(str(tmp_path / "merged"))
    assert not adapter_variables(plain)
    np.testing.assert_allclose(plain(inputs).numpy(), one_lora(inputs).numpy(), rtol=0, atol=1e-5)
    assert np.abs(plain(inputs).numpy() - model(inputs).numpy()).max() > 1e-4  # not the base

