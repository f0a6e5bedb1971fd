"""How to train: `TrainConfig`, every field a trainer flag.

Importing this module does not import TensorFlow.
"""

import dataclasses

from tfgpt.config.checks import require_positive_int as _require_positive_int
from tfgpt.config.checks import require_towers_divide_batch
from tfgpt.config.models import ALBERT_PRESETS, BERT_PRESETS, GPT_PRESETS

# Horovod: megabytes of gradients per grouped allreduce (the trainers'
# --allreduce-bucket-mb default; see tfgpt.distributed.horovod_bridge).
ALLREDUCE_BUCKET_MB = 3.0


MIXED_PRECISION = ("off", "float16", "bfloat16")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "lamb")
TASKS = ("auto", "clm", "mlm", "mlm+nsp", "mlm+sop")


@dataclasses.dataclass
class TrainConfig:
    """How to train: data, steps, optimisation, precision, output.

    Every field is a trainer flag (`batch_size` is `--batch-size`).

    Args:
        data: str. Directory written by `python -m pipelines.prepare`
            (`--format encoder` for the masked-LM tasks).
        preset: str. Model preset (`gpt-*`, `bert-*`, `albert-*`); model
            flags override its fields.
        task: str. `clm` (GPT), `mlm`, `mlm+nsp` (BERT) or `mlm+sop`
            (ALBERT); `auto` takes the preset family's pretraining task.
        steps: int. Optimizer steps to run in total.
        batch_size: int. Sequences per worker per step.
        learning_rate: float. Peak learning rate for one worker; with
            `scale_learning_rate` it is multiplied by the number of workers.
        scale_learning_rate: bool. Scale the learning rate linearly with the
            number of workers (Goyal et al. 2017, Horovod's recipe).
        warmup_steps: int. Linear warmup from 0 to the peak.
        schedule: str. Decay after warmup: cosine, linear or constant.
        final_learning_rate_ratio: float. Learning rate at the last step as
            a fraction of the peak.
        optimizer: str. `adamw`, or `lamb` (You et al. 2020; the ALBERT
            recipe: lr 0.00176, batch 4096, warmup 3125 of 125000 steps,
            linear decay to 0).
        weight_decay: float. Decoupled weight decay (not applied to biases,
            layer norms and embeddings).
        gradient_clip_norm: float. Global-norm clipping; 0 disables it.
        accumulation_steps: int. Micro-batches whose gradients are averaged
            before each update: the global batch is batch_size x
            accumulation_steps x workers.
        xla: bool. Compile the whole training step with XLA (one process;
            under Horovod the forward/backward pass and the update, with
            the allreduce between them). Off by default: on CPU, XLA's
            bfloat16 matmuls are several times slower than the oneDNN
            kernels graph mode uses (README, Performance).
        mixed_precision: str. off, float16 (with dynamic loss scaling) or
            bfloat16. Variables stay float32 either way.
        seed: int. Seed for weights, dropout and data order.
        shuffle: bool. Shuffle shards and records (seeded); off reads every
            worker's part in file order.
        skip_corrupt: bool. Leave shards that fail their size or checksum
            check out of the run, with a warning that counts them, instead
            of stopping (the epoch is topped up so every worker still runs
            the same number of steps).
        out: str. Output directory: checkpoints, config.json, TensorBoard
            scalars and metrics.jsonl.
        log_every: int. Steps between log lines.
        save_every: int. Steps between checkpoints; 0 saves only at the end.
        keep_checkpoints: int. Checkpoints kept on disk.
        eval_batches: int. Validation batches per worker at the end; 0 reads
            the whole validation split once.
        resume: bool. Continue from the latest checkpoint in `out`.
        intra_op_threads: int. Threads per worker for one op; 0 divides the
            machine's cores among the workers on it.
        towers: int. Slices of each worker's batch whose forward and
            backward passes run side by side, each op of a slice on
            threads / towers threads (`tfgpt.distributed.cpu_threads`):
            on CPU, two one-thread chains beat one two-thread chain at
            small models' shapes. 0 chooses: 2 on a CPU worker with at
            least 2 threads, one replica, XLA off and an even batch size,
            else 1. Must divide `batch_size`.
        peak_flops: float. Peak FLOP/s of one worker's device, for MFU; 0
            measures a chain of 2048x2048 matmuls in the training dtype at
            start-up.
        fp16_allreduce: bool. Horovod only: send gradients as float16.
        allreduce_bucket_mb: float. Horovod only: megabytes of gradients
            per grouped allreduce, cut in backward order; 0 sends each
            gradient on its own.
        recompute: bool. Keep only each transformer block's input for the
            backward pass and recompute the rest there (`tf.recompute_grad`):
            less activation memory for about a third more compute, same
            gradients. A training-time choice the trainer applies to the
            model (`tfgpt.layers.transformer_block.set_recompute`), not part
            of the architecture; GPT models only.
        profile_steps: str. `START,END`: record a TensorFlow profiler trace
            of steps START to END (1-based and inclusive, as logged) in
            OUT/profile, on the chief only (`python -m bench.profile_summary
            OUT/profile` prints where the time went). Empty: no trace.
    """

    data: str = ""
    preset: str = "gpt-demo"
    task: str = "auto"
    steps: int = 1000
    batch_size: int = 16
    learning_rate: float = 1e-3
    scale_learning_rate: bool = True
    warmup_steps: int = 100
    schedule: str = "cosine"
    final_learning_rate_ratio: float = 0.1
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    gradient_clip_norm: float = 1.0
    accumulation_steps: int = 1
    xla: bool = False
    mixed_precision: str = "off"
    seed: int = 0
    shuffle: bool = True
    skip_corrupt: bool = False
    out: str = "runs/gpt"
    log_every: int = 10
    save_every: int = 0
    keep_checkpoints: int = 3
    eval_batches: int = 50
    resume: bool = False
    intra_op_threads: int = 0
    towers: int = 0
    peak_flops: float = 0.0
    fp16_allreduce: bool = False
    allreduce_bucket_mb: float = ALLREDUCE_BUCKET_MB
    recompute: bool = False
    profile_steps: str = ""

    def __post_init__(self):
        self.profile_range()  # validates profile_steps
        if not self.data:
            raise ValueError("`data` is required: the directory written by pipelines.prepare.")
        for name in ("steps", "batch_size", "log_every", "keep_checkpoints", "accumulation_steps"):
            _require_positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "save_every", "eval_batches", "intra_op_threads", "towers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"`{name}` must be a non-negative integer. Received: {name}={value!r}"
                )
        require_towers_divide_batch(self.batch_size, self.towers)
        if not self.learning_rate > 0:
            raise ValueError(
                f"`learning_rate` must be positive. Received: learning_rate={self.learning_rate!r}"
            )
        for name, allowed in (
            ("mixed_precision", MIXED_PRECISION),
            ("schedule", SCHEDULES),
            ("optimizer", OPTIMIZERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"`{name}` must be one of {allowed}. Received: {name}={getattr(self, name)!r}"
                )
        presets = {**GPT_PRESETS, **BERT_PRESETS, **ALBERT_PRESETS}
        if self.preset not in presets:
            raise ValueError(
                f"Unknown preset. Received: preset={self.preset!r}. "
                f"Expected one of: {', '.join(sorted(presets))}"
            )
        if self.task not in TASKS:
            raise ValueError(f"`task` must be one of {TASKS}. Received: task={self.task!r}")
        for name in ("weight_decay", "gradient_clip_norm", "final_learning_rate_ratio", "peak_flops",
                     "allreduce_bucket_mb"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"`{name}` must be non-negative. Received: {name}={getattr(self, name)!r}"
                )


    def profile_range(self):
        """`profile_steps` as `(start, end)`, or None when empty."""
        if not self.profile_steps:
            return None
        parts = self.profile_steps.split(",")
        try:
            start, end = (int(part) for part in parts)
        except ValueError:
            start = end = None
        if start is None or not 1 <= start <= end:
            raise ValueError(
                "`profile_steps` must be START,END with 1 <= START <= END. "
                f"Received: profile_steps={self.profile_steps!r}"
            )
        return start, end


