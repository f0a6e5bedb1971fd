"""Model configurations, named presets and the family registry.

One dataclass per model family is the single source of truth: its field names
are the model's constructor arguments, the keys of `get_config()` and the
command-line flags of the trainers, and its `__post_init__` checks them. Build
a model with `GPT(**dataclasses.asdict(config))`. Importing this module does
not import TensorFlow.
"""

import dataclasses
import importlib
import typing

from tfgpt.config.checks import (
    require_bool,
    require_divisible,
    require_fraction,
    require_one_of,
    require_positive_int,
    require_positive_number,
)

# Activation names of the feed-forward layers and the masked-LM transform,
# for the whole code base (`tfgpt.layers.activated_dense` computes them).
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")

# How a field is checked: by its name where the name says more than its
# type, else by its type (every int field is a positive count).
_CHECKS_BY_NAME = {
    "dropout": require_fraction,
    "layer_norm_epsilon": require_positive_number,
    "activation": lambda name, value: require_one_of(name, value, ACTIVATIONS),
}
_CHECKS_BY_TYPE = {int: require_positive_int, bool: require_bool}


@dataclasses.dataclass
class TransformerConfig:
    """The fields every model family has: the shape of a stack of blocks.

    The defaults are GPT-2 small's without dropout; each family's config
    overrides those that differ and adds its own.

    Args:
        vocabulary_size: int. Number of token ids.
        num_layers: int. Number of transformer blocks applied in sequence.
        num_heads: int. Attention heads per block; must divide `hidden_dim`.
        hidden_dim: int. Width of the residual stream.
        intermediate_dim: int. Width of the feed-forward hidden layer.
        max_sequence_length: int. Rows of the learned position table: the
            longest input the model accepts.
        dropout: float. Dropout rate on embeddings, attention probabilities
            and both residual branches, in [0, 1).
        activation: str. Feed-forward (and masked-LM transform) activation:
            `"gelu"` (exact, erf; BERT), `"gelu_tanh"` (the tanh
            approximation: GPT-2's and ALBERT's `gelu_new`) or `"relu"`.
        norm_first: bool. Pre-layer-norm blocks and a final layer norm
            (GPT-2) when True; post-layer-norm (the original Transformer,
            BERT, ALBERT) when False.
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
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        """Raises ValueError naming the first field that is out of range."""
        for field in dataclasses.fields(self):
            check = _CHECKS_BY_NAME.get(field.name) or _CHECKS_BY_TYPE[field.type]
            check(field.name, getattr(self, field.name))
        require_divisible("hidden_dim", self.hidden_dim, "num_heads", self.num_heads)

    @classmethod
    def from_preset(cls, name, **overrides):
        """Returns the preset `name` of this family with `overrides` applied on top."""
        presets = next(
            family.presets for family in FAMILIES.values() if family.config_class is cls
        )
        if name not in presets:
            raise ValueError(
                f"Unknown preset. Received: preset={name!r}. "
                f"Expected one of: {', '.join(sorted(presets))}"
            )
        unknown = set(overrides) - {field.name for field in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"Unknown {cls.__name__} field(s): {', '.join(sorted(unknown))}"
            )
        return cls(**{**presets[name], **overrides})


@dataclasses.dataclass
class GPTConfig(TransformerConfig):
    """Shape of a GPT decoder (Radford et al. 2019).

    The fields of `TransformerConfig` (defaults: GPT-2 small without
    dropout) and:

    Args:
        tie_embeddings: bool. Reuse the token embedding matrix as the output
            projection (GPT-2) instead of a separate one.
    """

    tie_embeddings: bool = True


@dataclasses.dataclass
class EncoderConfig(TransformerConfig):
    """The fields BERT and ALBERT share: post-LN blocks and segment ids.

    Args:
        num_segments: int. Rows of the segment (token type) table: 2 for
            sentence pairs.
    """

    max_sequence_length: int = 512
    norm_first: bool = False
    layer_norm_epsilon: float = 1e-12
    num_segments: int = 2


@dataclasses.dataclass
class BertConfig(EncoderConfig):
    """Shape of a BERT encoder (Devlin et al. 2019).

    The fields of `EncoderConfig`; the defaults are bert-base's (Section 3:
    the uncased WordPiece vocabulary of 30522 ids, 512 positions, 2
    segments, exact GELU, dropout 0.1).
    """

    vocabulary_size: int = 30522
    dropout: float = 0.1
    activation: str = "gelu"


@dataclasses.dataclass
class AlbertConfig(EncoderConfig):
    """Shape of an ALBERT encoder (Lan et al. 2020).

    The fields of `EncoderConfig` (defaults: albert-base v2 as released: the
    SentencePiece vocabulary of 30000 ids, `gelu_new`, no dropout) and:

    Args:
        embedding_dim: int. Width of the token, position and segment
            embeddings (E), projected to `hidden_dim` before the first block
            (factorised embedding parameterisation).
        num_groups: int. Number of distinct sets of block parameters; must
            divide `num_layers`. Consecutive runs of
            `num_layers // num_groups` layers share one set; 1 (ALBERT)
            shares a single block across all layers.
    """

    vocabulary_size: int = 30000
    embedding_dim: int = 128
    num_groups: int = 1

    def __post_init__(self):
        super().__post_init__()
        require_divisible("num_layers", self.num_layers, "num_groups", self.num_groups)


def _validator(config_class):
    def validate(**fields):
        config_class(**fields)

    validate.__doc__ = (
        f"Raises ValueError naming the first field out of range (`{config_class.__name__}`)."
    )
    return validate


# The checks as functions of the fields, for callers that hold no config.
validate_gpt_config = _validator(GPTConfig)
validate_bert_config = _validator(BertConfig)
validate_albert_config = _validator(AlbertConfig)


def _sized(config_class, num_layers, hidden_dim, num_heads, **fields):
    """Every field of `config_class`: its defaults, a size, intermediate = 4H."""
    config = config_class(
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=4 * hidden_dim,
        **fields,
    )
    return dataclasses.asdict(config)


# Published parameter counts of the GPT-2 family (tied embeddings): 124M,
# 355M, 774M and 1558M (Radford et al. 2019, as counted by the released
# checkpoints). tests/test_gpt.py asserts the exact integers.
GPT_PRESETS: dict[str, dict[str, typing.Any]] = {
    # Sized for a 2-core CPU: about 2M parameters, trains in minutes.
    "gpt-demo": _sized(GPTConfig, 4, 192, 4, vocabulary_size=2000, max_sequence_length=128),
    # nanoGPT's character-level Shakespeare shape (6 layers, 6 heads, 384).
    "gpt-mini": _sized(GPTConfig, 6, 384, 6, vocabulary_size=2000, max_sequence_length=256),
    "gpt2-small": _sized(GPTConfig, 12, 768, 12, dropout=0.1),
    "gpt2-medium": _sized(GPTConfig, 24, 1024, 16, dropout=0.1),
    "gpt2-large": _sized(GPTConfig, 36, 1280, 20, dropout=0.1),
    "gpt2-xl": _sized(GPTConfig, 48, 1600, 25, dropout=0.1),
}

# Parameter counts of the backbones (embeddings, blocks, pooler; no
# pretraining heads), asserted as exact integers in tests/test_bert.py and
# tests/test_albert.py and equal to transformers' BertModel/AlbertModel of the
# same shape: bert-base 109,482,240 ("110M"), bert-large 335,141,888 ("340M").
BERT_PRESETS: dict[str, dict[str, typing.Any]] = {
    # Sized for a 2-core CPU, like gpt-demo.
    "bert-demo": _sized(
        BertConfig, 4, 192, 4, vocabulary_size=2000, max_sequence_length=128, dropout=0.0
    ),
    "bert-base": _sized(BertConfig, 12, 768, 12),
    "bert-large": _sized(BertConfig, 24, 1024, 16),
}

# albert-base 11,683,584 ("12M"), albert-large 17,683,968 ("18M"),
# albert-xlarge 58,724,864 ("60M"), albert-xxlarge 222,595,584 (the paper's
# Table 1 says 235M; the released architecture it describes counts 222.6M).
# Lan et al. 2020, Table 1, as released (v2): E = 128, all layers share one
# block.
ALBERT_PRESETS: dict[str, dict[str, typing.Any]] = {
    "albert-demo": _sized(
        AlbertConfig, 4, 192, 4, vocabulary_size=2000, max_sequence_length=128, embedding_dim=64
    ),
    "albert-base": _sized(AlbertConfig, 12, 768, 12),
    "albert-large": _sized(AlbertConfig, 24, 1024, 16),
    # The released xlarge uses 16 heads of width 128, not the paper's H/64.
    "albert-xlarge": _sized(AlbertConfig, 24, 2048, 16),
    "albert-xxlarge": _sized(AlbertConfig, 12, 4096, 64),
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
            is what `--task auto` picks, and the part after its `+` the
            family's sentence-pair task (`pair_task`).
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

    @property
    def pair_task(self):
        """The sentence-pair task its pretraining adds to the masked LM
        (`"nsp"`, `"sop"`), or None: the part after `+` of its tasks."""
        pairs = [task.split("+", 1)[1] for task in self.tasks if "+" in task]
        return pairs[0] if pairs else None

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
