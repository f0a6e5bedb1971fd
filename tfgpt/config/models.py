"""Model configurations, named presets and the family registry.

One dataclass per model family is the single source of truth: its field names
are the model's constructor arguments, the keys of `get_config()` and the
command-line flags of the trainers. Build a model with
`GPT(**dataclasses.asdict(config))`. Importing this module does not import
TensorFlow.
"""

import dataclasses
import importlib
import typing

from tfgpt.config.checks import require_positive_int as _require_positive_int

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


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


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config, presets, pretraining tasks and models.

    The model classes are named as `"module:Class"` and imported when asked
    for, so that the registry (and `--help`) does not import TensorFlow.

    Args:
        name: str. `"gpt"`, `"bert"` or `"albert"`: the name written into a
            run's `config.json`.
        config_class: type. The family's config dataclass.
        presets: dict. Preset name -> config fields.
        tasks: tuple of str. Pretraining tasks this family trains; the first
            is what `--task auto` picks.
        backbone: str. `"module:Class"` of the backbone (for GPT, the model).
        pretraining_model: str. `"module:Class"` of the backbone with its
            pretraining heads.
    """

    name: str
    config_class: type
    presets: dict
    tasks: tuple
    backbone: str
    pretraining_model: str

    def backbone_class(self):
        return _import_class(self.backbone)

    def pretraining_class(self):
        return _import_class(self.pretraining_model)

    def resolve_task(self, task):
        """Returns the concrete pretraining task for `--task`, or raises."""
        if task == "auto":
            return self.tasks[0]
        if task not in self.tasks:
            raise ValueError(
                f"--task {task} does not train a {self.name} model; "
                f"it takes --task {' or '.join(self.tasks)}"
            )
        return task


def _import_class(path):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


FAMILIES = {
    family.name: family
    for family in (
        Family("gpt", GPTConfig, GPT_PRESETS, ("clm",),
               "tfgpt.models.gpt:GPT", "tfgpt.models.gpt:GPT"),
        Family("bert", BertConfig, BERT_PRESETS, ("mlm+nsp", "mlm"),
               "tfgpt.models.bert:BertBackbone", "tfgpt.models.bert:Bert"),
        Family("albert", AlbertConfig, ALBERT_PRESETS, ("mlm+sop", "mlm"),
               "tfgpt.models.albert:AlbertBackbone", "tfgpt.models.albert:Albert"),
    )
}
ENCODER_FAMILIES = ("bert", "albert")


def family_of_preset(preset):
    """Returns the `Family` whose presets include `preset`, or raises."""
    for family in FAMILIES.values():
        if preset in family.presets:
            return family
    known = sorted(name for family in FAMILIES.values() for name in family.presets)
    raise ValueError(
        f"Unknown preset. Received: preset={preset!r}. Expected one of: {', '.join(known)}"
    )
