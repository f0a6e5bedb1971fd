"""The one table of refused combinations (`tfgpt.parallel.refusals`): every
row refuses what it names, in one line, and lets through what it does not.

The front ends reach it: `HorovodOptions` at flag parsing, the trainer and
the fine-tuner before anything is built, `model.fit`'s optimizer.
"""

import dataclasses
import doctest
import types

import pytest

from tfgpt.config.distribution import HorovodOptions
from tfgpt.config.finetuning import FinetuneConfig
from tfgpt.config.training import TrainConfig
from tfgpt.parallel import refusals
from tfgpt.parallel.refusals import REFUSALS, Run, check
from tfgpt.parallel.state import ParallelState


def _config(**fields):
    return TrainConfig(data="d", **fields)


# (the run, the start of its one line): one case per row of the table at least.
CASES = [
    (Run(elastic=True, zero_stage=1), "--elastic cannot re-shard --zero-stage 1 state when "
                                      "workers come and go: use --zero-stage 0 with --elastic"),
    (Run(elastic=True, tensor=2), "--elastic cannot re-split --tensor-parallel 2 slices"),
    (Run(elastic=True, pipeline=2), "--elastic cannot re-cut --pipeline-parallel 2 stages"),
    (Run(elastic=True, command="finetuning"), "--elastic is for pretraining (train_hvd.py): "
                                               "fine-tuning runs on a fixed set of workers"),
    (Run(pipeline=2, zero_stage=3), "--zero-stage 3 does not combine with --pipeline-parallel: "
                                    "use --zero-stage 1"),
    (Run(tensor=2, zero_stage=2), "--tensor-parallel 2 does not combine with --zero-stage 2: "
                                  "use --zero-stage 1"),
    (Run(command="fit", zero_stage=2), "model.fit averages whole gradients on every worker; "
                                       "--zero-stage 2 (sharded state) needs train_hvd.py"),
    (Run(command="finetuning", tensor=2), "--tensor-parallel 2 splits GPT pretraining "
                                          "(train_hvd.py) only"),
    (Run(command="finetuning", pipeline=2), "--pipeline-parallel 2 cuts a GPT for pretraining"),
    (Run(tensor=2, family="albert", config=_config(preset="albert-demo")),
     "--tensor-parallel 2 splits GPT models only; --preset albert-demo is a albert model"),
    (Run(tensor=2, config=_config(xla=True)),
     "--tensor-parallel 2 does not combine with --xla yet"),
    (Run(zero_stage=3, config=_config(xla=True)), "--xla cannot compile a --zero-stage 3 step"),
    (Run(tensor=2, config=_config(optimizer="lamb")),
     "--tensor-parallel 2 does not combine with --optimizer lamb yet"),
    (Run(pipeline=2, family="bert", config=_config(preset="bert-demo")),
     "--pipeline-parallel 2 cuts a GPT into stages; --preset bert-demo is a bert model"),
    (Run(pipeline=2, config=_config(accumulation_steps=2)),
     "--pipeline-parallel 2 cannot be combined with --accumulation-steps 2: the pipeline "
     "accumulates over --microbatches"),
    (Run(pipeline=2, config=_config(xla=True)), "--pipeline-parallel 2 cannot be combined with "
                                                "--xla: the pipeline's steps"),
    (Run(pipeline=3, config=_config(towers=2)),
     "--pipeline-parallel 3 cannot be combined with --towers 2: a pipeline stage runs one tower"),
]


@pytest.mark.parametrize("run, line", CASES)
def test_each_refusal_is_one_line_naming_the_flags(run, line):
    with pytest.raises(ValueError) as error:
        check(run)
    message = str(error.value)
    assert message.startswith(line) and "\n" not in message, message
    # One process, whole and unsharded, refuses nothing but --elastic fine-tuning.
    whole = dataclasses.replace(run, tensor=1, pipeline=1, zero_stage=0)
    if not (run.elastic and run.command == "finetuning"):
        check(whole)


def test_every_row_of_the_table_is_reached_by_a_case_and_what_fits_passes():
    reached = {next(index for index, (refused, _) in enumerate(REFUSALS) if refused(run))
               for run, _ in CASES}
    assert reached == set(range(len(REFUSALS)))
    assert doctest.testmod(refusals).failed == 0
    # What the layouts do combine with.
    for run in (Run(), Run(tensor=2, pipeline=2, zero_stage=1, family="gpt", config=_config()),
                Run(tensor=2, pipeline=2, family="gpt", config=_config(mixed_precision="float16")),
                Run(zero_stage=2, config=_config(optimizer="lamb", xla=True)),
                Run(elastic=True), Run(command="finetuning", zero_stage=3),
                Run(tensor=2, zero_stage=1, config=_config(lora_rank=4)),
                Run(pipeline=2, family="gpt", config=_config(task="sft", lora_rank=4))):
        check(run)


def test_the_front_ends_ask_the_table():
    # Flags, before Horovod starts.
    with pytest.raises(ValueError, match="--zero-stage 2 does not combine with --pipeline"):
        HorovodOptions(pipeline_parallel=2, zero_stage=2)
    HorovodOptions(pipeline_parallel=2, zero_stage=1)
    # The fine-tuner, from the distribution's parallel state.
    from tfgpt.finetuning.finetuner import finetune

    config = FinetuneConfig.__new__(FinetuneConfig)  # never read: refused first
    for state, line in ((ParallelState(2, tensor=2), "--tensor-parallel 2 splits GPT "),
                        (ParallelState(2, pipeline=2), "--pipeline-parallel 2 cuts a GPT ")):
        distribution = types.SimpleNamespace(state=state, options=None)
        with pytest.raises(ValueError, match=line):
            finetune(config, {}, distribution)
    # model.fit's optimizer, from the distribution it averages with.
    import keras

    from tfgpt.parallel.keras_horovod import DistributedOptimizer

    distribution = types.SimpleNamespace(state=ParallelState(1, zero_stage=1))
    with pytest.raises(ValueError, match="model.fit averages whole gradients"):
        DistributedOptimizer(keras.optimizers.SGD(), distribution=distribution)
