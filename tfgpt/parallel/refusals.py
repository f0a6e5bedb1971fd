"""The one table of what a parallel layout does not combine with, each refusal one line.

A run is checked as soon as its flags are parsed (`HorovodOptions`: the
sizes, ZeRO's stage, `--elastic`) and again once its model and run config
are known (the trainer, the fine-tuner, `model.fit`'s optimizer): the
first refusal whose condition holds raises one `ValueError` that names
the flags and, where there is one, what to use instead. What is not yet
known (`family`, `config`) is None, and the rules that need it wait.
Importing this module does not import TensorFlow.

Example:
>>> check(Run(tensor=2, zero_stage=1))
>>> check(Run(tensor=2, zero_stage=2))
Traceback (most recent call last):
...
ValueError: --tensor-parallel 2 does not combine with --zero-stage 2: use --zero-stage 1, which shards each slice's optimizer state over its replicas
"""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Run:
    """What is known of a run when it is checked.

    Args:
        tensor, pipeline: int. `--tensor-parallel`, `--pipeline-parallel`.
        zero_stage: int. `--zero-stage`.
        elastic: bool. `--elastic`.
        command: str. `"pretraining"`, `"finetuning"` or `"fit"` (Keras
            `model.fit` under Horovod).
        family: str or None. The model family (`gpt`, `bert`, `albert`).
        config: the run config (`TrainConfig`, `FinetuneConfig`) or None.
    """

    tensor: int = 1
    pipeline: int = 1
    zero_stage: int = 0
    elastic: bool = False
    command: str = "pretraining"
    family: Any = None
    config: Any = None

    @classmethod
    def of(cls, state, **known):
        """The run of a `tfgpt.parallel.state.ParallelState` and what else is `known`."""
        return cls(tensor=state.tensor, pipeline=state.pipeline, zero_stage=state.zero_stage,
                   **known)


def _config(run, test):
    return run.config is not None and test(run.config)


def _family(run, test):
    return run.family is not None and test(run.family)


T, P = "--tensor-parallel {r.tensor}", "--pipeline-parallel {r.pipeline}"
# (when it is refused, what the one line says), checked in this order.
REFUSALS = [
    # Elastic runs re-form on any number of workers: nothing may be cut by the world size.
    (lambda r: r.elastic and r.zero_stage,
     "--elastic cannot re-shard --zero-stage {r.zero_stage} state when workers come and go: "
     "use --zero-stage 0 with --elastic"),
    (lambda r: r.elastic and r.tensor > 1,
     "--elastic cannot re-split " + T + " slices when workers come and go: use "
     "--tensor-parallel 1 with --elastic"),
    (lambda r: r.elastic and r.pipeline > 1,
     "--elastic cannot re-cut " + P + " stages when workers come and go: use "
     "--pipeline-parallel 1 with --elastic"),
    (lambda r: r.elastic and r.command == "finetuning",
     "--elastic is for pretraining (train_hvd.py): fine-tuning runs on a fixed set of workers"),
    # ZeRO above 1 shards gradients or weights over the whole world, not a data group.
    (lambda r: r.pipeline > 1 and r.zero_stage > 1,
     "--zero-stage {r.zero_stage} does not combine with --pipeline-parallel: use "
     "--zero-stage 1, which shards each stage's optimizer state over its replicas. "
     "Received: zero_stage={r.zero_stage}, pipeline_parallel={r.pipeline}"),
    (lambda r: r.tensor > 1 and r.zero_stage > 1,
     T + " does not combine with --zero-stage {r.zero_stage}: use --zero-stage 1, which "
     "shards each slice's optimizer state over its replicas"),
    (lambda r: r.zero_stage == 3 and _config(r, lambda c: c.xla),
     "--xla cannot compile a --zero-stage 3 step: its forward pass gathers each block's "
     "weights with Horovod collectives, which XLA cannot run; use --zero-stage 1 or 2 with "
     "--xla"),
    (lambda r: r.command == "fit" and r.zero_stage,
     "model.fit averages whole gradients on every worker; --zero-stage {r.zero_stage} "
     "(sharded state) needs train_hvd.py or finetune_hvd.py under horovodrun"),
    # Fine-tuning trains encoders, which are neither split nor cut.
    (lambda r: r.command == "finetuning" and r.tensor > 1,
     T + " splits GPT pretraining (train_hvd.py) only; fine-tuning trains BERT and ALBERT, "
     "whose layers are not split"),
    (lambda r: r.command == "finetuning" and r.pipeline > 1,
     P + " cuts a GPT for pretraining (train_hvd.py); fine-tuning runs the whole encoder on "
     "every worker"),
    # Tensor parallelism splits GPT's blocks, vocabulary and optimizer updates.
    (lambda r: r.tensor > 1 and _family(r, lambda f: f != "gpt"),
     T + " splits GPT models only; --preset {r.config.preset} is a {r.family} model (its "
     "bidirectional attention, embeddings and heads are not split)"),
    (lambda r: r.tensor > 1 and _config(r, lambda c: c.xla),  # Horovod ops in an XLA cluster
     T + " does not combine with --xla yet"),
    (lambda r: r.tensor > 1 and _config(r, lambda c: c.optimizer == "lamb"),  # per-variable norms
     T + " does not combine with --optimizer lamb yet"),
    # A pipeline cuts a GPT into stages that exchange activations between passes.
    (lambda r: r.pipeline > 1 and _family(r, lambda f: f != "gpt"),
     P + " cuts a GPT into stages; --preset {r.config.preset} is a {r.family} model"),
    (lambda r: r.pipeline > 1 and _config(r, lambda c: c.accumulation_steps > 1),
     P + " cannot be combined with --accumulation-steps {r.config.accumulation_steps}: the "
     "pipeline accumulates over --microbatches; raise --batch-size and --microbatches instead"),
    (lambda r: r.pipeline > 1 and _config(r, lambda c: c.xla),
     P + " cannot be combined with --xla: the pipeline's steps run Horovod transfers between "
     "the stages' passes, which XLA cannot compile"),
    (lambda r: r.pipeline > 1 and _config(r, lambda c: c.towers > 1),
     P + " cannot be combined with --towers {r.config.towers}: a pipeline stage runs one tower"),
]


def check(run):
    """Raises ValueError with the first refusal of `REFUSALS` that `run` meets."""
    for refused, message in REFUSALS:
        if refused(run):
            raise ValueError(message.format(r=run))
