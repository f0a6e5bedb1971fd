"""Model configurations and named presets.

One dataclass per model family is the single source of truth: its field names
are the model's constructor arguments, the keys of `get_config()` and the
command-line flags of the trainers. Build a model with
`GPT(**dataclasses.asdict(config))`.
"""

import dataclasses
import typing

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")

# Horovod: megabytes of gradients per grouped allreduce (the trainers'
# --allreduce-bucket-mb default; see tfgpt.distributed.horovod_bridge).
ALLREDUCE_BUCKET_MB = 3.0


@dataclasses.dataclass
class GPTConfig:
    """Shape of a GPT decoder.

    Args:
        vocabulary_size: int. Number of token ids.
        num_layers: int. Number of transformer blocks.
        num_heads: int. Attention heads per block; must divide `hidden_dim`.
        hidden_dim: int. Width of the residual stream.
        intermediate_dim: int. Width of the feed-forward hidden layer.
        max_sequence_length: int. Rows of the learned position table: the
            longest context the model accepts.
        dropout: float. Dropout rate on embeddings, attention probabilities
            and both residual branches, in [0, 1).
        activation: str. Feed-forward activation: `"gelu"` (exact, erf),
            `"gelu_tanh"` (the tanh approximation GPT-2 uses) or `"relu"`.
        norm_first: bool. Pre-layer-norm (GPT-2) when True, post-layer-norm
            (the original Transformer) when False.
        tie_embeddings: bool. Reuse the token embedding matrix as the output
            projection (GPT-2) instead of a separate one.
        layer_norm_epsilon: float. Epsilon of every layer norm.
    """

    vocabulary_size: int = 50257
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    intermediate_dim: int = 3072
    max_sequence_length: int = 1024
    dropout: float = 0.0
    activation: str = "gelu_tanh"
    norm_first: bool = True
    tie_embeddings: bool = True
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        validate_gpt_config(**dataclasses.asdict(self))

    @classmethod
    def from_preset(cls, name, **overrides):
        """Returns the preset `name` with `overrides` applied on top."""
        if name not in GPT_PRESETS:
            raise ValueError(
                f"Unknown preset. Received: preset={name!r}. "
                f"Expected one of: {', '.join(sorted(GPT_PRESETS))}"
            )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"Unknown GPTConfig field(s): {', '.join(sorted(unknown))}"
            )
        return cls(**{**GPT_PRESETS[name], **overrides})


def _require_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}"
        )


def require_towers_divide_batch(batch_size, towers):
    """Raises unless `towers` (0: chosen later) divides `batch_size`."""
    if towers and batch_size % towers:
        raise ValueError(
            "`batch_size` must be divisible by `towers`. "
            f"Received: batch_size={batch_size}, towers={towers}"
        )


def validate_gpt_config(
    vocabulary_size,
    num_layers,
    num_heads,
    hidden_dim,
    intermediate_dim,
    max_sequence_length,
    dropout,
    activation,
    norm_first,
    tie_embeddings,
    layer_norm_epsilon,
):
    """Raises ValueError naming the first field that is out of range."""
    for name, value in (
        ("vocabulary_size", vocabulary_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("hidden_dim", hidden_dim),
        ("intermediate_dim", intermediate_dim),
        ("max_sequence_length", max_sequence_length),
    ):
        _require_positive_int(name, value)
    if hidden_dim % num_heads:
        raise ValueError(
            "`hidden_dim` must be divisible by `num_heads`. "
            f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"`activation` must be one of {ACTIVATIONS}. "
            f"Received: activation={activation!r}"
        )
    for name, value in (("norm_first", norm_first), ("tie_embeddings", tie_embeddings)):
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
    if not layer_norm_epsilon > 0:
        raise ValueError(
            "`layer_norm_epsilon` must be positive. "
            f"Received: layer_norm_epsilon={layer_norm_epsilon!r}"
        )


def _gpt2(num_layers, hidden_dim, num_heads):
    return dict(
        vocabulary_size=50257,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=4 * hidden_dim,
        max_sequence_length=1024,
        dropout=0.1,
        activation="gelu_tanh",
        norm_first=True,
        tie_embeddings=True,
        layer_norm_epsilon=1e-5,
    )


# Published parameter counts of the GPT-2 family (tied embeddings): 124M,
# 355M, 774M and 1558M (Radford et al. 2019, as counted by the released
# checkpoints). tests/test_gpt.py asserts the exact integers.
GPT_PRESETS: dict[str, dict[str, typing.Any]] = {
    # Sized for a 2-core CPU: about 2M parameters, trains in minutes.
    "gpt-demo": dict(
        vocabulary_size=2000,
        num_layers=4,
        num_heads=4,
        hidden_dim=192,
        intermediate_dim=768,
        max_sequence_length=128,
        dropout=0.0,
        activation="gelu_tanh",
        norm_first=True,
        tie_embeddings=True,
        layer_norm_epsilon=1e-5,
    ),
    # nanoGPT's character-level Shakespeare shape (6 layers, 6 heads, 384).
    "gpt-mini": dict(
        vocabulary_size=2000,
        num_layers=6,
        num_heads=6,
        hidden_dim=384,
        intermediate_dim=1536,
        max_sequence_length=256,
        dropout=0.0,
        activation="gelu_tanh",
        norm_first=True,
        tie_embeddings=True,
        layer_norm_epsilon=1e-5,
    ),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
}


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


def _preset_config(cls, presets, name, overrides):
    """Builds `cls` from `presets[name]` with `overrides`; errors name the key."""
    if name not in presets:
        raise ValueError(
            f"Unknown preset. Received: preset={name!r}. "
            f"Expected one of: {', '.join(sorted(presets))}"
        )
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(
            f"Unknown {cls.__name__} field(s): {', '.join(sorted(unknown))}"
        )
    return cls(**{**presets[name], **overrides})


@dataclasses.dataclass
class BertConfig:
    """Shape of a BERT encoder (Devlin et al. 2019).

    Args:
        vocabulary_size: int. Number of token ids.
        num_layers: int. Number of encoder blocks.
        num_heads: int. Attention heads per block; must divide `hidden_dim`.
        hidden_dim: int. Width of the residual stream and of the embeddings.
        intermediate_dim: int. Width of the feed-forward hidden layer.
        max_sequence_length: int. Rows of the learned position table.
        num_segments: int. Rows of the segment (token type) table: 2 for
            sentence pairs.
        dropout: float. Dropout rate on embeddings, attention probabilities
            and both residual branches, in [0, 1).
        activation: str. Feed-forward and masked-LM transform activation:
            `"gelu"` (exact, BERT), `"gelu_tanh"` or `"relu"`.
        norm_first: bool. Pre-layer-norm blocks and a final layer norm when
            True; post-layer-norm (BERT) when False.
        layer_norm_epsilon: float. Epsilon of every layer norm.
    """

    vocabulary_size: int = 30522
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    intermediate_dim: int = 3072
    max_sequence_length: int = 512
    num_segments: int = 2
    dropout: float = 0.1
    activation: str = "gelu"
    norm_first: bool = False
    layer_norm_epsilon: float = 1e-12

    def __post_init__(self):
        validate_bert_config(**dataclasses.asdict(self))

    @classmethod
    def from_preset(cls, name, **overrides):
        """Returns the preset `name` with `overrides` applied on top."""
        return _preset_config(cls, BERT_PRESETS, name, overrides)


def _validate_encoder_fields(
    num_segments, dropout, activation, norm_first, layer_norm_epsilon
):
    _require_positive_int("num_segments", num_segments)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"`activation` must be one of {ACTIVATIONS}. "
            f"Received: activation={activation!r}"
        )
    if not isinstance(norm_first, bool):
        raise ValueError(f"`norm_first` must be a bool. Received: norm_first={norm_first!r}")
    if not layer_norm_epsilon > 0:
        raise ValueError(
            "`layer_norm_epsilon` must be positive. "
            f"Received: layer_norm_epsilon={layer_norm_epsilon!r}"
        )


def validate_bert_config(
    vocabulary_size,
    num_layers,
    num_heads,
    hidden_dim,
    intermediate_dim,
    max_sequence_length,
    num_segments,
    dropout,
    activation,
    norm_first,
    layer_norm_epsilon,
):
    """Raises ValueError naming the first field that is out of range."""
    for name, value in (
        ("vocabulary_size", vocabulary_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("hidden_dim", hidden_dim),
        ("intermediate_dim", intermediate_dim),
        ("max_sequence_length", max_sequence_length),
    ):
        _require_positive_int(name, value)
    if hidden_dim % num_heads:
        raise ValueError(
            "`hidden_dim` must be divisible by `num_heads`. "
            f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
        )
    _validate_encoder_fields(num_segments, dropout, activation, norm_first, layer_norm_epsilon)


@dataclasses.dataclass
class AlbertConfig:
    """Shape of an ALBERT encoder (Lan et al. 2020).

    Args:
        vocabulary_size: int. Number of token ids.
        num_layers: int. Number of encoder blocks applied in sequence.
        num_heads: int. Attention heads per block; must divide `hidden_dim`.
        hidden_dim: int. Width of the residual stream (H).
        intermediate_dim: int. Width of the feed-forward hidden layer.
        embedding_dim: int. Width of the token, position and segment
            embeddings (E), projected to `hidden_dim` before the first block
            (factorised embedding parameterisation).
        num_groups: int. Number of distinct sets of block parameters; must
            divide `num_layers`. Consecutive runs of
            `num_layers // num_groups` layers share one set; 1 (ALBERT)
            shares a single block across all layers.
        max_sequence_length: int. Rows of the learned position table.
        num_segments: int. Rows of the segment (token type) table.
        dropout: float. Dropout rate, in [0, 1). ALBERT v2 trains with 0.
        activation: str. `"gelu_tanh"` (ALBERT's `gelu_new`), `"gelu"` or
            `"relu"`.
        norm_first: bool. Pre-layer-norm blocks and a final layer norm when
            True; post-layer-norm (ALBERT) when False.
        layer_norm_epsilon: float. Epsilon of every layer norm.
    """

    vocabulary_size: int = 30000
    num_layers: int = 12
    num_heads: int = 12
    hidden_dim: int = 768
    intermediate_dim: int = 3072
    embedding_dim: int = 128
    num_groups: int = 1
    max_sequence_length: int = 512
    num_segments: int = 2
    dropout: float = 0.0
    activation: str = "gelu_tanh"
    norm_first: bool = False
    layer_norm_epsilon: float = 1e-12

    def __post_init__(self):
        validate_albert_config(**dataclasses.asdict(self))

    @classmethod
    def from_preset(cls, name, **overrides):
        """Returns the preset `name` with `overrides` applied on top."""
        return _preset_config(cls, ALBERT_PRESETS, name, overrides)


def validate_albert_config(
    vocabulary_size,
    num_layers,
    num_heads,
    hidden_dim,
    intermediate_dim,
    embedding_dim,
    num_groups,
    max_sequence_length,
    num_segments,
    dropout,
    activation,
    norm_first,
    layer_norm_epsilon,
):
    """Raises ValueError naming the first field that is out of range."""
    validate_bert_config(
        vocabulary_size=vocabulary_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        max_sequence_length=max_sequence_length,
        num_segments=num_segments,
        dropout=dropout,
        activation=activation,
        norm_first=norm_first,
        layer_norm_epsilon=layer_norm_epsilon,
    )
    _require_positive_int("embedding_dim", embedding_dim)
    _require_positive_int("num_groups", num_groups)
    if num_layers % num_groups:
        raise ValueError(
            "`num_layers` must be divisible by `num_groups`. "
            f"Received: num_layers={num_layers}, num_groups={num_groups}"
        )


def _bert(num_layers, hidden_dim, num_heads):
    # Devlin et al. 2019, Section 3: the uncased WordPiece vocabulary
    # of 30522 ids, 512 positions, 2 segments, intermediate = 4H.
    return dict(
        vocabulary_size=30522,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=4 * hidden_dim,
        max_sequence_length=512,
        num_segments=2,
        dropout=0.1,
        activation="gelu",
        norm_first=False,
        layer_norm_epsilon=1e-12,
    )


def _albert(num_layers, hidden_dim, num_heads):
    # Lan et al. 2020, Table 1, as released (v2): SentencePiece vocabulary of
    # 30000 ids, E = 128, intermediate = 4H, all layers share one block,
    # no dropout, gelu_new.
    return dict(
        vocabulary_size=30000,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=4 * hidden_dim,
        embedding_dim=128,
        num_groups=1,
        max_sequence_length=512,
        num_segments=2,
        dropout=0.0,
        activation="gelu_tanh",
        norm_first=False,
        layer_norm_epsilon=1e-12,
    )


# Parameter counts of the backbones (embeddings, blocks, pooler; no
# pretraining heads), asserted as exact integers in tests/test_bert.py and
# tests/test_albert.py and equal to transformers' BertModel/AlbertModel of the
# same shape: bert-base 109,482,240 ("110M"), bert-large 335,141,888 ("340M").
BERT_PRESETS: dict[str, dict[str, typing.Any]] = {
    # Sized for a 2-core CPU, like gpt-demo.
    "bert-demo": dict(
        vocabulary_size=2000,
        num_layers=4,
        num_heads=4,
        hidden_dim=192,
        intermediate_dim=768,
        max_sequence_length=128,
        num_segments=2,
        dropout=0.0,
        activation="gelu",
        norm_first=False,
        layer_norm_epsilon=1e-12,
    ),
    "bert-base": _bert(12, 768, 12),
    "bert-large": _bert(24, 1024, 16),
}

# albert-base 11,683,584 ("12M"), albert-large 17,683,968 ("18M"),
# albert-xlarge 58,724,864 ("60M"), albert-xxlarge 222,595,584 (the paper's
# Table 1 says 235M; the released architecture it describes counts 222.6M).
ALBERT_PRESETS: dict[str, dict[str, typing.Any]] = {
    "albert-demo": dict(
        vocabulary_size=2000,
        num_layers=4,
        num_heads=4,
        hidden_dim=192,
        intermediate_dim=768,
        embedding_dim=64,
        num_groups=1,
        max_sequence_length=128,
        num_segments=2,
        dropout=0.0,
        activation="gelu_tanh",
        norm_first=False,
        layer_norm_epsilon=1e-12,
    ),
    "albert-base": _albert(12, 768, 12),
    "albert-large": _albert(24, 1024, 16),
    # The released xlarge uses 16 heads of width 128, not the paper's H/64.
    "albert-xlarge": _albert(24, 2048, 16),
    "albert-xxlarge": _albert(12, 4096, 64),
}
