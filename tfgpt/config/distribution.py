"""The front ends' own flags: how each distributes the run.

`HorovodOptions` are `train_hvd.py`'s and `finetune_hvd.py`'s,
`StrategyOptions` `train_mirrored.py`'s and `finetune_mirrored.py`'s; a
distribution is built from its options and the run's config
(`HorovodDistribution.create(options, config)`,
`StrategyDistribution.create(options, config)`). Importing this module
does not import TensorFlow.
"""

import dataclasses
import socket

from tfgpt.config.checks import require_non_negative_int, require_positive_int
from tfgpt.config.training import ALLREDUCE_BUCKET_MB, require_one_of
from tfgpt.parallel import refusals

STRATEGIES = ("default", "one-device", "mirrored", "multi-worker")
ZERO_STAGES = (0, 1, 2, 3)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
PIPELINE_PARTITIONS = ("uniform", "balanced")
ALLREDUCE_TRANSPORTS = ("auto", "shared-memory", "horovod")
# How long a rank waits for a peer that stopped taking part (--collective-timeout).
COLLECTIVE_TIMEOUT_SECONDS = 1800.0


def check_pipeline_schedule(schedule, stages, microbatches, virtual_stages):
    """Raises ValueError unless a pipeline schedule's sizes fit together."""
    require_one_of("pipeline_schedule", schedule, PIPELINE_SCHEDULES)
    require_positive_int("pipeline_parallel", stages)
    require_positive_int("microbatches", microbatches)
    require_positive_int("virtual_stages", virtual_stages)
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ValueError(
                "--pipeline-schedule interleaved needs --virtual-stages of at least 2 "
                f"(with 1 it is 1f1b). Received: virtual_stages={virtual_stages}"
            )
        if microbatches % stages:
            raise ValueError(
                "--pipeline-schedule interleaved takes micro-batches in groups of "
                "--pipeline-parallel: --microbatches must be divisible by it. Received: "
                f"microbatches={microbatches}, pipeline_parallel={stages}"
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"--virtual-stages is for --pipeline-schedule interleaved; {schedule} runs one "
            f"chunk per rank. Received: virtual_stages={virtual_stages}"
        )


@dataclasses.dataclass
class HorovodOptions:
    """How Horovod averages the gradients.

    Args:
        fp16_allreduce: bool. Send gradients as float16 over the wire
            (halves allreduce traffic).
        allreduce_bucket_mb: float. Megabytes of gradients per grouped
            allreduce (or reduce-scatter), cut in backward order; 0 sends
            each gradient on its own.
        allreduce_transport: str. How the gradients are averaged:
            shared-memory (workers on one host, CPU: one copy in and out
            of a shared segment per step, no sockets), horovod (Horovod's
            allreduce, in buckets), or auto (shared-memory where it
            applies: one host, no GPU, data parallelism without ZeRO,
            tensor or pipeline parallelism, elastic or --fp16-allreduce;
            horovod otherwise).
        zero_stage: int. Shard the training state over the workers (ZeRO):
            1 the optimizer moments, 2 also the gradients, 3 also the
            parameters, gathered block by block when used; 0 keeps all of
            it on every worker (docs/parallel.md).
            With --tensor-parallel, --pipeline-parallel or both only 1:
            each slice's, stage's or stage's slice's moments are sharded
            over its data replicas.
        elastic: bool. Pretraining only: elastic training (`horovodrun
            --min-np/--max-np --host-discovery-script`). When a worker is
            lost the others go back to the last commit and go on without
            it; a worker that joins receives the state from rank 0. Each
            worker keeps --batch-size, so the global batch follows the
            world size, and so does the learning rate with
            --scale-learning-rate. The data is read in one global order
            and repartitioned at every change, so each training sequence
            of an epoch is used once (docs/elastic.md).
        commit_every: int. With --elastic, steps between commits: copies
            of the whole training state and the data position in memory,
            what a lost worker sends the others back to. Separate from
            --save-every (checkpoints on disk).
        tensor_parallel: int. Split each GPT block's attention heads and
            feed-forward width, and the vocabulary, over this many
            consecutive ranks (Megatron-LM's tensor parallelism; GPT
            only); the other factor of the ranks is data parallelism. Must
            divide the ranks, the heads, the intermediate size and the
            vocabulary (round --vocabulary-size up to a multiple); 1 keeps
            every block whole (docs/parallel.md, Tensor parallelism). With
            --pipeline-parallel P too, each stage's blocks are split: the
            N ranks are data x P x T, tensor groups innermost.
        pipeline_parallel: int. Pipeline stages: each of this many workers
            runs a contiguous part of the GPT's blocks (the embeddings with
            the first, the final norm, head and loss with the last), and
            micro-batches flow through them (docs/parallel.md, Pipeline
            parallelism). 1: no pipeline. The number of workers must be a
            multiple: N workers run N / P pipelines side by side, each on
            its part of the data, each stage's gradients averaged over the
            pipelines.
        microbatches: int. Micro-batches each batch is cut into for the
            pipeline; must divide --batch-size. Their gradients are
            accumulated into one optimizer step.
        pipeline_schedule: str. Order of the forward and backward passes:
            gpipe (all forward, then all backward: every micro-batch's
            activations held at once), 1f1b (one forward, one backward:
            at most --pipeline-parallel in flight), interleaved (1f1b over
            --virtual-stages chunks per worker: a bubble that many times
            smaller, more transfers).
        virtual_stages: int. Chunks of blocks per worker for the
            interleaved schedule (at least 2); 1 otherwise.
        pipeline_partition: str. How blocks are cut into stages: uniform
            (the same number each) or balanced (the same forward FLOPs,
            counting the head's projection to the vocabulary with the
            last stage).
        check_batches: bool. Compare a fingerprint of every step's batch
            across each tensor group and pipeline (one allgather each), not
            only of the first step's: a debugging aid.
        collective_timeout: float. Seconds a rank waits for a peer that
            stopped taking part (stopped, hung, cut off) before the run
            ends with one line naming it: the shared-memory average's
            wait (data parallelism on one host), and the watchdog of every
            layout and transport, which ends a rank whose loop has not
            moved for this long plus a grace of 5 s and a tenth
            (`tfgpt.resilience.watchdog`; its heartbeats live in
            OUT/.heartbeats). Longer than ranks ever drift apart or a step
            ever lasts: the first step's tracing, and the chief alone
            writing the replicated state of a checkpoint while the others
            wait (a GPT-2 XL's weights and moments are 18 GB).
    """

    CHOICES = {"zero_stage": ZERO_STAGES, "pipeline_schedule": PIPELINE_SCHEDULES,
               "pipeline_partition": PIPELINE_PARTITIONS,
               "allreduce_transport": ALLREDUCE_TRANSPORTS}

    fp16_allreduce: bool = False
    allreduce_bucket_mb: float = ALLREDUCE_BUCKET_MB
    allreduce_transport: str = "auto"
    zero_stage: int = 0
    elastic: bool = False
    commit_every: int = 10
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    pipeline_partition: str = "uniform"
    check_batches: bool = False
    collective_timeout: float = COLLECTIVE_TIMEOUT_SECONDS

    def __post_init__(self):
        if not self.allreduce_bucket_mb >= 0:
            raise ValueError(
                "`allreduce_bucket_mb` must be non-negative. "
                f"Received: allreduce_bucket_mb={self.allreduce_bucket_mb!r}"
            )
        if not self.collective_timeout > 0:
            raise ValueError(
                "`collective_timeout` must be positive. "
                f"Received: collective_timeout={self.collective_timeout!r}"
            )
        require_one_of("zero_stage", self.zero_stage, ZERO_STAGES)
        require_one_of("allreduce_transport", self.allreduce_transport, ALLREDUCE_TRANSPORTS)
        require_positive_int("commit_every", self.commit_every)
        require_positive_int("tensor_parallel", self.tensor_parallel)
        require_one_of("pipeline_partition", self.pipeline_partition, PIPELINE_PARTITIONS)
        check_pipeline_schedule(self.pipeline_schedule, self.pipeline_parallel,
                                self.microbatches, self.virtual_stages)
        if self.pipeline_parallel == 1 and (self.microbatches > 1 or self.virtual_stages > 1):
            raise ValueError(
                "--microbatches and --virtual-stages cut batches for a pipeline: they need "
                "--pipeline-parallel of at least 2 (--accumulation-steps accumulates without "
                f"one). Received: microbatches={self.microbatches}, "
                f"virtual_stages={self.virtual_stages}, pipeline_parallel=1"
            )
        refusals.check(refusals.Run(tensor=self.tensor_parallel, pipeline=self.pipeline_parallel,
                                    zero_stage=self.zero_stage, elastic=self.elastic))


@dataclasses.dataclass
class StrategyOptions:
    """Which tf.distribute strategy runs the replicas.

    Args:
        strategy: str. `mirrored`: one replica per GPU (or per logical CPU
            device); `multi-worker`: MultiWorkerMirrored, one process per
            worker with the cluster in `TF_CONFIG`; `one-device`, or
            `default` (no strategy).
        logical_cpus: int. Split the CPU into this many logical devices,
            one replica each (machines without GPUs); 0 or 1 keeps one.
    """

    CHOICES = {"strategy": STRATEGIES}

    strategy: str = "mirrored"
    logical_cpus: int = 0

    def __post_init__(self):
        require_one_of("strategy", self.strategy, STRATEGIES)
        require_non_negative_int("logical_cpus", self.logical_cpus)


# Which front ends take each options class's flags, for the error a flag of
# the other kind gets (`--zero-stage` given to train_mirrored.py).
FRONT_ENDS = {
    HorovodOptions: "train_hvd.py and finetune_hvd.py (Horovod, under horovodrun)",
    StrategyOptions: "train_mirrored.py and finetune_mirrored.py (tf.distribute)",
}


def localhost_cluster(count):
    """The `TF_CONFIG` cluster of `count` MultiWorkerMirrored workers on this machine.

    Each worker gets a localhost port that was free a moment ago (the tests'
    and the scaling benchmark's multi-worker runs).
    """
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return {"worker": [f"localhost:{port}" for port in ports]}
