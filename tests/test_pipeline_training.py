"""train_hvd.py --pipeline-parallel end to end: flags, refusals, checkpoints, resume."""

import os
import shutil
import sys

import pytest

from tests.launch import REPO, horovodrun, run, train_losses
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
