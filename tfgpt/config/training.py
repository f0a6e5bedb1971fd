"""How to train: `RunConfig`, what every run shares, and `TrainConfig`.

Every field is a flag of the front end that reads the config
(`batch_size` is `--batch-size`); `tfgpt.training.flags` generates the
flags, with each one's help taken from the `Args:` entry of its field.
`tfgpt.config.finetuning.FinetuneConfig` extends `RunConfig` too.

Importing this module does not import TensorFlow.
"""

import dataclasses
import typing

from tfgpt.config.checks import require_non_negative_int, require_towers_divide_batch
from tfgpt.config.checks import require_positive_int as _require_positive_int
from tfgpt.config.models import FAMILIES

# Horovod: megabytes of gradients per grouped allreduce (the Horovod front
# ends' --allreduce-bucket-mb default; see tfgpt.parallel.horovod_bridge).
ALLREDUCE_BUCKET_MB = 3.0


MIXED_PRECISION = ("off", "float16", "bfloat16")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "lamb")
TASKS = ("auto", "clm", "sft", "mlm", "mlm+nsp", "mlm+sop")
MONITOR_RULES = ("on", "off")
PREEMPTION_SIGNALS = ("TERM", "USR1", "USR2", "INT", "off")  # tfgpt.resilience.preemption


def require_one_of(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}. Received: {name}={value!r}")


@dataclasses.dataclass
class RunConfig:
    """What every run shares: steps, optimisation, precision, devices, output.

    `TrainConfig` (pretraining) and `FinetuneConfig` (fine-tuning) extend
    it; the run core (`tfgpt.training.loop`) reads only these fields.

    Args:
        steps: int. Optimizer steps to run in total.
        batch_size: int. Sequences per replica per micro-batch: the global
            batch is batch_size x accumulation_steps x replicas.
        learning_rate: float. Peak learning rate for one worker; with
            `scale_learning_rate` it is multiplied by the number of replicas.
        scale_learning_rate: bool. Scale the learning rate linearly with the
            number of replicas (Goyal et al. 2017, Horovod's recipe).
        schedule: str. Decay after the linear warmup.
        final_learning_rate_ratio: float. Learning rate at the last step as
            a fraction of the peak.
        optimizer: str. AdamW (beta 0.9/0.95, decoupled decay), or LAMB as
            published (You et al. 2020; the ALBERT recipe: lr 0.00176,
            batch 4096, warmup 3125 of 125000 steps, linear decay to 0).
        weight_decay: float. Decoupled weight decay (not applied to biases,
            layer norms and embeddings).
        gradient_clip_norm: float. Global-norm clipping of the averaged
            gradients; 0 disables it.
        accumulation_steps: int. Micro-batches whose gradients are averaged
            before each update (equal to one that many times larger batch).
        xla: bool. Compile the training step with XLA (one process: all of
            it; under Horovod the forward/backward pass and the update, with
            the allreduce between them; under tf.distribute the
            forward/backward pass). Off by default: on CPU, XLA's bfloat16
            matmuls are several times slower than the oneDNN kernels graph
            mode uses (docs/training.md, --xla).
        mixed_precision: str. float16 (with dynamic loss scaling, logging
            `loss_scale` and `skipped_steps`) or bfloat16 activations;
            variables, logits and the loss stay float32 either way.
        seed: int. Seed for initial weights, dropout and data order.
        shuffle: bool. Shuffle the training data (seeded); off reads every
            worker's part in file order.
        global_order: bool. Every data replica takes its share of one
            global order of the records (the order `--elastic` reads), so a
            run resumed on another number of data replicas continues the
            same stream of global batches. Each worker reads the whole
            split and keeps its share; off, each worker reads its own files.
        out: str. Output directory: checkpoints, config.json, TensorBoard
            scalars and metrics.jsonl.
        log_every: int. Steps between log lines.
        save_every: int. Steps between checkpoints; 0 saves only at the end.
        keep_checkpoints: int. Checkpoints kept on disk.
        resume: bool. Continue from the latest checkpoint in `out`.
        intra_op_threads: int. Threads per worker for one op; 0 divides the
            machine's cores among the workers on it.
        towers: int. Slices of each worker's batch whose forward and
            backward passes run side by side, each op of a slice on
            threads / towers threads (`tfgpt.parallel.cpu_threads`):
            on CPU, two one-thread chains beat one two-thread chain at
            small models' shapes. 0 chooses: 2 on a CPU worker with at
            least 2 threads, one replica, XLA off and an even batch size,
            else 1. Must divide `batch_size`.
        peak_flops: float. Peak FLOP/s of one worker, for MFU; 0 measures
            chains of 2048x2048 matmuls in the training dtype at start-up,
            one per tower, once per machine (kept under `TFGPT_CACHE_DIR`,
            default ~/.cache/tfgpt; `tfgpt.observe.flops.cached_matmul_peak`).
        profile_steps: str. `START,END`: record a TensorFlow profiler trace
            of steps START to END (1-based and inclusive, as logged) in
            OUT/profile, on the chief only (`python -m bench.profile_summary
            OUT/profile` prints where the time went). Empty: no trace.
        monitor_rules: str. `on`: name known problems from each logging
            window's time split and host figures, one warning line the
            first time each fires (input-bound, straggler,
            communication-bound, low-utilisation, memory-growth,
            loss-not-falling, gradient-spike; `tfgpt.observe.monitor`).
            `off`: log the figures only.
        preemption_signal: str. The signal a scheduler sends before it ends
            the job (TERM, USR1, USR2, INT; `off` catches none): every rank
            stops after the same step, saves its checkpoint and the process
            exits with status 75, which deploy/slurm requeues; `--resume`
            continues exactly (`tfgpt.resilience.preemption`).
        preemption_grace: float. Seconds after the signal within which the
            process ends, with or without the new checkpoint: less than
            the scheduler's own grace (Slurm's KillWait and Kubernetes'
            terminationGracePeriodSeconds are 30 s by default).
    """

    # Validation tables (not fields): each subclass extends them.
    CHOICES: typing.ClassVar[dict] = {
        "schedule": SCHEDULES,
        "optimizer": OPTIMIZERS,
        "mixed_precision": MIXED_PRECISION,
        "monitor_rules": MONITOR_RULES,
        "preemption_signal": PREEMPTION_SIGNALS,
    }
    POSITIVE_INTS: typing.ClassVar[tuple] = (
        "batch_size", "log_every", "keep_checkpoints", "accumulation_steps",
    )
    NON_NEGATIVE_INTS: typing.ClassVar[tuple] = (
        "save_every", "intra_op_threads", "towers",
    )
    NON_NEGATIVE_NUMBERS: typing.ClassVar[tuple] = (
        "weight_decay", "gradient_clip_norm", "final_learning_rate_ratio", "peak_flops",
    )
    POSITIVE_NUMBERS: typing.ClassVar[tuple] = ("preemption_grace",)
    # The flag that sets the warmup, for the start-up warning.
    WARMUP_FLAG: typing.ClassVar[str] = "--warmup-steps"

    steps: int = 1000
    batch_size: int = 16
    learning_rate: float = 1e-3
    scale_learning_rate: bool = True
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
    global_order: bool = False
    out: str = "runs/gpt"
    log_every: int = 10
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    intra_op_threads: int = 0
    towers: int = 0
    peak_flops: float = 0.0
    profile_steps: str = ""
    monitor_rules: str = "on"
    preemption_signal: str = "TERM"
    preemption_grace: float = 25.0

    def __post_init__(self):
        self.profile_range()  # validates profile_steps
        for name in self.POSITIVE_INTS:
            _require_positive_int(name, getattr(self, name))
        for name in self.NON_NEGATIVE_INTS:
            require_non_negative_int(name, getattr(self, name))
        require_towers_divide_batch(self.batch_size, self.towers)
        if not self.learning_rate > 0:
            raise ValueError(
                f"`learning_rate` must be positive. Received: learning_rate={self.learning_rate!r}"
            )
        for name, allowed in self.CHOICES.items():
            require_one_of(name, getattr(self, name), allowed)
        for name in self.NON_NEGATIVE_NUMBERS:
            if not getattr(self, name) >= 0:
                raise ValueError(
                    f"`{name}` must be non-negative. Received: {name}={getattr(self, name)!r}"
                )
        for name in self.POSITIVE_NUMBERS:
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"`{name}` must be positive. Received: {name}={getattr(self, name)!r}"
                )

    def warmup_steps_of(self, steps):
        """Warmup steps of a run of `steps` steps (subclasses say how they set it)."""
        raise NotImplementedError

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


@dataclasses.dataclass
class TrainConfig(RunConfig):
    """How to pretrain: data, model, task, and what every run shares.

    The fields are these and `RunConfig`'s. Every field is a flag of
    `train_hvd.py` and `train_mirrored.py`.

    Args:
        data: str. Directory written by `python -m pipelines.prepare`
            (`--format encoder` for the masked-LM tasks).
        preset: str. Model preset (`gpt-*`, `bert-*`, `albert-*`); model
            flags override its fields.
        task: str. `clm` (GPT), `sft` (a GPT on instruction records,
            `pipelines.prepare --format instructions`: the completions
            learned), `mlm`, `mlm+nsp` (BERT) or `mlm+sop` (ALBERT); `auto`
            takes the preset family's pretraining task.
        warmup_steps: int. Linear warmup from 0 to the peak learning rate.
        skip_corrupt: bool. Leave shards that fail their size or checksum
            check out of the run, with a warning that counts them, instead
            of stopping (the epoch is topped up so every worker still runs
            the same number of steps).
        eval_batches: int. Validation batches per worker at the end; 0 reads
            the whole validation split once.
        recompute: bool. Keep only each transformer block's input for the
            backward pass and recompute the rest there (`tf.recompute_grad`):
            less activation memory for about a third more compute, same
            gradients. A training-time choice the trainer applies to the
            model (`tfgpt.layers.transformer_block.set_recompute`), not part
            of the architecture; GPT models only.
        init: str. A tfgpt GPT run directory to start from, whatever layout
            wrote it: its architecture (`config.json`; model flags override
            it) and the weights of its latest checkpoint; the optimizer and
            the step start afresh. The data must be prepared with its
            tokenizer (`pipelines.prepare --tokenizer INIT`). A Hugging Face
            decoder directory becomes one with `python -m tfgpt.convert
            to-tfgpt`. Ignored when `--resume` finds a checkpoint in `out`.
        lora_rank: int. Above 0: freeze the model and train low-rank adapters
            of this rank on the projections `lora_targets` names
            (`tfgpt.models.adapters`); the optimizer holds state for them
            alone. GPT models, on every layout (a pipeline's stages each train
            their own blocks' adapters).
        lora_alpha: float. The adapters' scale is `lora_alpha / lora_rank`.
        lora_dropout: float. Dropout on the adapters' input.
        lora_targets: str. Comma-separated projection names (`query_key_value`,
            `query`, `key_value`, `output_projection`, `feedforward_gate`,
            `feedforward_intermediate`, `feedforward_output`), each one the
            model has (the default names the fused and the grouped-query
            attention's input: the model's is taken).
    """

    CHOICES: typing.ClassVar[dict] = {**RunConfig.CHOICES, "task": TASKS}
    POSITIVE_INTS: typing.ClassVar[tuple] = ("steps",) + RunConfig.POSITIVE_INTS
    NON_NEGATIVE_INTS: typing.ClassVar[tuple] = (
        ("warmup_steps",) + RunConfig.NON_NEGATIVE_INTS + ("eval_batches", "lora_rank")
    )
    NON_NEGATIVE_NUMBERS: typing.ClassVar[tuple] = (
        RunConfig.NON_NEGATIVE_NUMBERS + ("lora_alpha", "lora_dropout"))
    PRESETS: typing.ClassVar[tuple] = tuple(
        name for family in FAMILIES.values() for name in family.presets
    )

    data: str = ""
    preset: str = "gpt-demo"
    task: str = "auto"
    warmup_steps: int = 100
    skip_corrupt: bool = False
    eval_batches: int = 50
    recompute: bool = False
    init: str = ""
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "query_key_value,query,key_value,output_projection"

    def __post_init__(self):
        if not self.data:
            raise ValueError("`data` is required: the directory written by pipelines.prepare.")
        super().__post_init__()
        if self.preset not in self.PRESETS:
            raise ValueError(
                f"Unknown preset. Received: preset={self.preset!r}. "
                f"Expected one of: {', '.join(sorted(self.PRESETS))}"
            )

    def warmup_steps_of(self, steps):
        return self.warmup_steps
