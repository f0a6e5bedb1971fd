"""Model configurations, named presets and the family registry.

The presets come from the families' folders (`tfgpt/models/<family>/`,
listed in `tfgpt.models.decoder_families` and
`tfgpt.models.encoder_families`), the dataclasses are here.

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
    require_non_negative_int,
    require_one_of,
    require_positive_int,
    require_positive_number,
)
from tfgpt.models.decoder_families import DECODER_FAMILIES
from tfgpt.models.encoder_families import ENCODER_FAMILIES as _ENCODER_FAMILIES

# Activation names of the feed-forward layers and the masked-LM transform,
# for the whole code base (`tfgpt.layers.activated_dense` computes them).
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
# The decoder's switches (`GPTConfig`): what each takes.
NORMS = ("layer", "rms")
POSITIONS = ("learned", "rotary")
ROPE_SCALINGS = ("none", "linear", "llama3")
FEEDFORWARDS = ("dense", "gated")
RESIDUALS = ("sequential", "parallel", "parallel_two_norms")
WINDOW_LAYERS = ("all", "odd")


def _require_rotary_fraction(name, value):
    require_positive_number(name, value)
    if value > 1:
        raise ValueError(f"`{name}` must be in (0, 1]. Received: {name}={value!r}")

# How a field is checked: by its name where the name says more than its
# type, else by its type (every int field is a positive count).
_CHECKS_BY_NAME = {
    "dropout": require_fraction,
    "layer_norm_epsilon": require_positive_number,
    "activation": lambda name, value: require_one_of(name, value, ACTIVATIONS),
    "norm": lambda name, value: require_one_of(name, value, NORMS),
    "positions": lambda name, value: require_one_of(name, value, POSITIONS),
    "rope_scaling": lambda name, value: require_one_of(name, value, ROPE_SCALINGS),
    "feedforward": lambda name, value: require_one_of(name, value, FEEDFORWARDS),
    "residual": lambda name, value: require_one_of(name, value, RESIDUALS),
    "window_layers": lambda name, value: require_one_of(name, value, WINDOW_LAYERS),
    "num_key_value_heads": require_non_negative_int,
    "head_dim": require_non_negative_int,
    "pad_id": require_non_negative_int,
    "sliding_window": require_non_negative_int,
    "rotary_fraction": _require_rotary_fraction,
    "rope_theta": require_positive_number,
    "rope_factor": require_positive_number,
    "rope_low_frequency_factor": require_positive_number,
    "rope_high_frequency_factor": require_positive_number,
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
        if not getattr(self, "head_dim", 0):  # an explicit head width need not divide it
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
    """Shape of a decoder: GPT-2 (Radford et al. 2019) and its successors.

    The fields of `TransformerConfig` (defaults: GPT-2 small without
    dropout) and the switches that make the later decoders (the defaults
    are GPT-2's):

    Args:
        tie_embeddings: bool. Reuse the token embedding matrix as the output
            projection (GPT-2) instead of a separate one.
        norm: str. `"layer"` (LayerNorm, GPT-2) or `"rms"` (RMSNorm in
            float32 with a weight only: Llama, Mistral, Qwen2).
        positions: str. `"learned"` (a position table, GPT-2) or
            `"rotary"` (rotary embeddings on queries and keys, no table:
            Su et al. 2021).
        rotary_fraction: float. Share of each head's width that the rotary
            embedding turns, in (0, 1]: 1 for Llama, 0.25 for GPT-NeoX.
        rotary_interleaved: bool. Rotate pairs of adjacent features
            (GPT-J's `rotate_every_two`) instead of the first half against
            the second (GPT-NeoX, Llama).
        rope_theta: float. Base of the rotary frequencies.
        rope_scaling: str. How the rotary frequencies stretch to longer
            inputs: `"none"`, `"linear"` (positions divided by
            `rope_factor`) or `"llama3"` (Llama 3.1's: low frequencies
            divided by `rope_factor`, high ones kept, a blend between).
        rope_factor: float. The scaling's factor.
        rope_low_frequency_factor: float. `llama3` scaling: wavelengths
            above `rope_original_max_length / this` are scaled.
        rope_high_frequency_factor: float. `llama3` scaling: wavelengths
            below `rope_original_max_length / this` are kept.
        rope_original_max_length: int. `llama3` scaling: the context the
            frequencies were trained for.
        num_key_value_heads: int. Key and value heads, each shared by
            `num_heads / num_key_value_heads` query heads (grouped-query
            attention, Ainslie et al. 2023); 0: `num_heads` (multi-head).
        head_dim: int. Width of each head; 0: `hidden_dim / num_heads`.
        attention_bias: bool. Biases on the query, key and value projections.
        output_bias: bool. A bias on the attention's output projection.
        scale_attention: bool. Scale the scores by 1/sqrt(head_dim)
            (GPT-Neo does not).
        feedforward: str. `"dense"` (up, activation, down) or `"gated"`
            (`down(activation(gate) * up)`: SwiGLU with `silu`, Shazeer
            2020).
        feedforward_bias: bool. Biases on the feed-forward projections.
        residual: str. `"sequential"` (attention, then the feed-forward
            network on its result), `"parallel"` (both on one norm of the
            input, summed: GPT-J) or `"parallel_two_norms"` (each on its
            own norm: GPT-NeoX).
        lm_head_bias: bool. A bias on the untied output projection (GPT-J).
        sliding_window: int. Each token attends to itself and the
            `sliding_window - 1` tokens before it, in the layers
            `window_layers` names (Mistral: all; GPT-Neo: every second);
            0: to every token before it.
        window_layers: str. `"all"` or `"odd"` (layers 1, 3, 5, ...: GPT-Neo's
            alternation of global and local attention).
    """

    tie_embeddings: bool = True
    norm: str = "layer"
    positions: str = "learned"
    rotary_fraction: float = 1.0
    rotary_interleaved: bool = False
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_frequency_factor: float = 1.0
    rope_high_frequency_factor: float = 4.0
    rope_original_max_length: int = 8192
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = True
    output_bias: bool = True
    scale_attention: bool = True
    feedforward: str = "dense"
    feedforward_bias: bool = True
    residual: str = "sequential"
    lm_head_bias: bool = False
    sliding_window: int = 0
    window_layers: str = "all"

    def __post_init__(self):
        super().__post_init__()
        if self.num_key_value_heads:
            require_divisible("num_heads", self.num_heads, "num_key_value_heads",
                              self.num_key_value_heads)
        if self.positions == "rotary" and self.rotary_dim % 2:
            raise ValueError(
                "The rotary embedding turns pairs of features: `rotary_fraction` x `head_dim` "
                f"must be even. Received: rotary_fraction={self.rotary_fraction}, "
                f"head_dim={self.key_width}"
            )
        if self.lm_head_bias and self.tie_embeddings:
            raise ValueError("`lm_head_bias` needs an untied output projection: set "
                             "tie_embeddings=False. Received: lm_head_bias=True, "
                             "tie_embeddings=True")
        if self.residual != "sequential" and not self.norm_first:
            raise ValueError(f"A {self.residual} residual is pre-norm: set norm_first=True. "
                             f"Received: residual={self.residual!r}, norm_first=False")

    @property
    def key_value_heads(self):
        """Key and value heads (`num_key_value_heads`, or `num_heads`)."""
        return self.num_key_value_heads or self.num_heads

    @property
    def key_width(self):
        """Width of each head (`head_dim`, or `hidden_dim / num_heads`)."""
        return self.head_dim or self.hidden_dim // self.num_heads

    def window_of(self, layer):
        """The sliding window of block `layer` (0: none)."""
        if self.window_layers == "odd" and layer % 2 == 0:
            return 0
        return self.sliding_window

    @property
    def rotary_dim(self):
        """Features of each head the rotary embedding turns."""
        return int(self.rotary_fraction * self.key_width)


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

    @property
    def first_position(self):
        """The position-table row of the first real token: 0 (BERT, ALBERT).

        The table has `max_sequence_length + first_position` rows.
        """
        return 0


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


@dataclasses.dataclass
class RobertaConfig(EncoderConfig):
    """Shape of a RoBERTa encoder (Liu et al. 2019).

    BERT's encoder trained differently: the fields of `EncoderConfig`
    (defaults: roberta-base as released: GPT-2's byte-level BPE vocabulary
    of 50265 ids, one segment, layer-norm epsilon 1e-5, dropout 0.1) and:

    Args:
        pad_id: int. The padding token's id, below `vocabulary_size`.
            Positions count the non-pad tokens from `pad_id + 1` (fairseq's
            `make_positions`) and every pad token reads row `pad_id`, so the
            position table has `max_sequence_length + pad_id + 1` rows
            (514 for 512 tokens with `pad_id` 1).
    """

    vocabulary_size: int = 50265
    num_segments: int = 1
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.1
    activation: str = "gelu"
    pad_id: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.pad_id >= self.vocabulary_size:
            raise ValueError(
                "`pad_id` must be an id of the vocabulary (below `vocabulary_size`). "
                f"Received: pad_id={self.pad_id}, vocabulary_size={self.vocabulary_size}"
            )

    @property
    def first_position(self):
        """The position-table row of the first real token: `pad_id + 1`."""
        return self.pad_id + 1


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
validate_roberta_config = _validator(RobertaConfig)


def _completed(config_class, presets):
    """`presets` with every field of `config_class`: the fields each sets, the defaults."""
    return {name: dataclasses.asdict(config_class(**fields)) for name, fields in presets.items()}


# The decoder families' presets, from their folders (`tfgpt/models/<family>/presets.py`):
# GPT-2's (and tfgpt's small GPTs); every family's, GPT-2's first.
GPT_PRESETS: dict[str, dict[str, typing.Any]] = _completed(
    GPTConfig, DECODER_FAMILIES["gpt2"].presets)
DECODER_PRESETS: dict[str, dict[str, typing.Any]] = {
    name: fields for family in DECODER_FAMILIES.values()
    for name, fields in _completed(GPTConfig, family.presets).items()}


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its config, presets, pretraining tasks and models.

    The model classes are named as `"module:Class"` and imported when asked
    for, so that the registry (and `--help`) does not import TensorFlow.

    Args:
        name: str. `"gpt"`, `"bert"`, `"albert"` or `"roberta"`: the name
            written into a run's `config.json`.
        config_class: type. The family's config dataclass.
        presets: dict. Preset name -> config fields.
        tasks: tuple of str. Pretraining tasks this family trains; the first
            is what `--task auto` picks, and the part after its `+` the
            family's sentence-pair task (`pair_task`; RoBERTa has none).
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


# The encoder families' config dataclasses, by the names their folders declare.
_ENCODER_CONFIGS = {cls.__name__: cls for cls in (BertConfig, AlbertConfig, RobertaConfig)}

FAMILIES = {
    family.name: family
    for family in (
        Family("gpt", GPTConfig, DECODER_PRESETS, ("clm", "sft"),
               "tfgpt.models.gpt:GPT", "tfgpt.models.gpt:GPT"),
        *(Family(encoder.name, _ENCODER_CONFIGS[encoder.config_class],
                 _completed(_ENCODER_CONFIGS[encoder.config_class], encoder.presets),
                 encoder.tasks, encoder.backbone, encoder.pretraining_model)
          for encoder in _ENCODER_FAMILIES.values()),
    )
}
ENCODER_FAMILIES = tuple(_ENCODER_FAMILIES)
# The encoders the fine-tuning front ends take (`EncoderFamily.finetuning`).
FINETUNING_FAMILIES = tuple(name for name, family in _ENCODER_FAMILIES.items()
                            if family.finetuning)
# Each encoder family's presets, every field (from their folders' presets.py).
BERT_PRESETS: dict[str, dict[str, typing.Any]] = FAMILIES["bert"].presets
ALBERT_PRESETS: dict[str, dict[str, typing.Any]] = FAMILIES["albert"].presets
ROBERTA_PRESETS: dict[str, dict[str, typing.Any]] = FAMILIES["roberta"].presets


def family_of_preset(preset):
    """Returns the `Family` whose presets include `preset`, or raises."""
    for family in FAMILIES.values():
        if preset in family.presets:
            return family
    known = sorted(name for family in FAMILIES.values() for name in family.presets)
    raise ValueError(
        f"Unknown preset. Received: preset={preset!r}. Expected one of: {', '.join(known)}"
    )
