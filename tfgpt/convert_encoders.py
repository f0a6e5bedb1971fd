"""Encoder checkpoints in the transformers layout, in and out of tfgpt, for every encoder family.

Each encoder family (BERT, ALBERT, RoBERTa) is a folder of `tfgpt/models/`,
listed in `tfgpt.models.encoder_families`; the folder's `hf_conversion.py`
holds its `EncoderLayout`, the `config.json` keys and tensor names that
differ between the families. This module does the rest for all of them, by
the checkpoint's `model_type`.

A transformers checkpoint directory holds `config.json` and its weights
(`model.safetensors`, `pytorch_model.bin` or their shards: `tfgpt.hf_files`).
`load_hf_encoder` builds the matching tfgpt model from `config.json` and
copies every tensor into it; `load_hf_weights` fills a model you built;
`save_hf_encoder` writes a tfgpt encoder as such a directory, which
`transformers.AutoModel*.from_pretrained` reads. Nothing is downloaded: the
directory must already be on disk, e.g. from
`transformers.AutoModel.from_pretrained(...).save_pretrained(directory)`.

Layout differences handled here, for every family:
- torch `Linear.weight` is (out, in); a Keras `Dense.kernel` is (in, out).
- The masked-LM decoder is tied to the word embeddings and has a bias of
  its own; tfgpt's `MaskedLMHead` likewise reads the backbone's token
  embedding and owns `output_bias`.
- `max_position_embeddings` counts the rows before the first real token's
  (RoBERTa's `pad_token_id + 1`); tfgpt's `max_sequence_length` does not
  (the config's `first_position`).
- A model whose outputs do not use the pooler (`*ForQuestionAnswering`,
  a masked LM without a sentence-pair task) is written without it.

Example:
>>> model = load_hf_encoder("checkpoints/bert-base-uncased")  # doctest: +SKIP
>>> model({"token_ids": ids})["mlm_logits"]  # doctest: +SKIP
>>> save_hf_encoder(model, "exported")  # transformers.BertForPreTraining reads it  # doctest: +SKIP
"""

import dataclasses
import functools
import json
import os
import warnings

import numpy as np

from tfgpt.config import ENCODER_FAMILIES, FAMILIES
from tfgpt.hf_files import read_hf_checkpoint
from tfgpt.layers.layer_norm import LayerNorm
from tfgpt.models import encoder_families
from tfgpt.models.encoder_backbone import EncoderBackbone
from tfgpt.models.encoder_pretraining_model import EncoderPretrainingModel
from tfgpt.models.sequence_classifier import SequenceClassifier
from tfgpt.models.span_question_answerer import SpanQuestionAnswerer

HEADS = ("pretraining", "classification", "question_answering", None)


# The sublayers of a `TransformerBlock`, in the order `EncoderLayout.block_parts`
# names them.
BLOCK_PARTS = (
    "attention.query", "attention.key", "attention.value", "attention.output_projection",
    "attention_norm", "feedforward_intermediate", "feedforward_output", "feedforward_norm",
)


@dataclasses.dataclass(frozen=True)
class EncoderLayout:
    """Where a transformers checkpoint of one family keeps what tfgpt's model holds.

    Each encoder family's `hf_conversion.py` defines its `LAYOUT`
    (`tfgpt.models.encoder_family.EncoderFamily`).

    Args:
        fields: dict. tfgpt config field -> (config.json key, default; None:
            required), beyond the fields every family reads alike; written
            back under the same keys.
        required: dict. config.json key -> the value tfgpt's model needs
            (None also accepted when reading).
        block: str. A block's tensor prefix, `{index}` its index in
            `backbone.blocks`.
        block_parts: tuple of str. The names under it of `BLOCK_PARTS`.
        pooler: str. The pooler's dense layer.
        masked_lm: str. The masked-LM head (its bias is `{masked_lm}.bias`).
        masked_lm_transform: tuple of str. The names under `masked_lm` of
            the head's dense layer and layer norm.
        pair_classifier: str or None. The sentence-pair head's dense layer;
            None: no sentence-pair head.
        sequence_classifier: str or None. The dense layer of
            `*ForSequenceClassification`'s head; None: its head has a layout
            tfgpt neither reads nor writes.
        classes: str. The prefix of transformers' class names (`"Bert"`).
    """

    fields: dict
    required: dict
    block: str
    block_parts: tuple
    pooler: str
    masked_lm: str
    masked_lm_transform: tuple
    pair_classifier: str | None
    sequence_classifier: str | None
    classes: str


def _titles():
    """The encoder families' names as messages write them: "BERT, ALBERT or RoBERTa"."""
    *others, last = (family.title for family in encoder_families.ENCODER_FAMILIES.values())
    return f"{', '.join(others)} or {last}" if others else last


def _layout(family):
    """The `EncoderLayout` of the encoder family named `family` (its folder's)."""
    return encoder_families.ENCODER_FAMILIES[family].converter().LAYOUT


# transformers' activation names (transformers/activations.py ACT2FN) that
# equal a tfgpt activation.
_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
# What `save_hf_encoder` writes for each tfgpt activation.
_ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}

# ---- config.json -> tfgpt config --------------------------------------------


def hf_encoder_config(hf_config, source="config.json"):
    """Returns the config (`BertConfig`, ...) a transformers encoder's config describes.

    Raises ValueError, naming the field and its value, for a model type that
    is no encoder family's and for features tfgpt's encoders do not have
    (relative positions, decoders, ALBERT's inner groups).
    """
    model_type = hf_config.get("model_type")
    if model_type not in ENCODER_FAMILIES:
        raise ValueError(
            f"{source}: expected a {_titles()} checkpoint. "
            f"Received: model_type={model_type!r}"
        )
    layout = _layout(model_type)
    required = {
        "position_embedding_type": "absolute",
        "is_decoder": False,
        "add_cross_attention": False,
        **layout.required,
    }
    for field, needed in required.items():
        if hf_config.get(field) not in (needed, None):
            raise ValueError(
                f"{source}: unsupported architecture, tfgpt's {model_type} needs "
                f"{field}={needed!r}. Received: {field}={hf_config.get(field)!r}"
            )
    activation = hf_config.get("hidden_act")
    if activation not in _HF_ACTIVATIONS:
        raise ValueError(
            f"{source}: unsupported activation. Received: hidden_act={activation!r}. "
            f"Supported: {', '.join(_HF_ACTIVATIONS)}"
        )
    fields = dict(
        vocabulary_size=hf_config["vocab_size"],
        num_layers=hf_config["num_hidden_layers"],
        num_heads=hf_config["num_attention_heads"],
        hidden_dim=hf_config["hidden_size"],
        intermediate_dim=hf_config["intermediate_size"],
        max_sequence_length=hf_config["max_position_embeddings"],
        num_segments=hf_config["type_vocab_size"],
        dropout=float(hf_config.get("hidden_dropout_prob", 0.0)),
        activation=_HF_ACTIVATIONS[activation],
        norm_first=False,
        layer_norm_epsilon=float(hf_config["layer_norm_eps"]),
    )
    for field, (key, default) in layout.fields.items():
        fields[field] = hf_config.get(key) if default is None else hf_config.get(key, default)
    try:
        config = FAMILIES[model_type].config_class(**fields)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    # RoBERTa's table has rows before the first real token's (`first_position`).
    positions = fields["max_sequence_length"]
    if positions <= config.first_position:
        raise ValueError(
            f"{source}: `max_position_embeddings` must exceed pad_token_id + 1, the rows "
            f"before the first token's. Received: max_position_embeddings={positions}, "
            f"pad_token_id={hf_config.get('pad_token_id')!r}"
        )
    return dataclasses.replace(config, max_sequence_length=positions - config.first_position)


# ---- Building and loading ---------------------------------------------------


def load_hf_encoder(directory, family=None, head="pretraining"):
    """Builds the tfgpt model a transformers encoder checkpoint describes and loads it.

    Args:
        directory: str. A directory with `config.json` and its weights.
        family: str or None. `"bert"`, `"albert"` or `"roberta"` to insist
            on one; a checkpoint of another raises ValueError. None accepts
            each.
        head: str or None. Which model to build:
            `"pretraining"`: `Bert`/`Albert` with masked-LM and NSP/SOP
                heads (from a `*ForPreTraining` checkpoint), `Roberta` with
                its masked-LM head (from `RobertaForMaskedLM`);
            `"classification"`: `SequenceClassifier` (from a
                `*ForSequenceClassification` checkpoint; `num_classes` from
                `id2label`; not RoBERTa's, whose head has its own layout);
            `"question_answering"`: `SpanQuestionAnswerer` (from a
                `*ForQuestionAnswering` checkpoint);
            None: the backbone alone, from any of them.

    Returns:
        The model, in float32.
    """
    if head not in HEADS:
        raise ValueError(f"`head` must be one of {HEADS}. Received: head={head!r}")
    if family not in (*ENCODER_FAMILIES, None):
        raise ValueError(
            f"`family` must be one of {ENCODER_FAMILIES} or None. Received: family={family!r}"
        )
    hf_config, tensors = read_hf_checkpoint(directory)
    config = hf_encoder_config(hf_config, os.path.join(directory, "config.json"))
    model_type = hf_config["model_type"]
    if family is not None and model_type != family:
        raise ValueError(
            f"{directory} holds a different architecture: expected a {family} checkpoint. "
            f"Received: model_type={model_type!r}"
        )
    layout = _layout(model_type)
    if head == "classification" and layout.sequence_classifier is None:
        raise ValueError(
            f"{directory}: {layout.classes}ForSequenceClassification's head has its own "
            "layout, which tfgpt does not read; load the backbone alone. "
            f"Received: head={head!r}, model_type={model_type!r}"
        )
    fields = dataclasses.asdict(config)
    if head == "pretraining":
        model = FAMILIES[model_type].pretraining_class()(**fields)
    else:
        backbone = FAMILIES[model_type].backbone_class()(**fields)
        if head is None:
            model = backbone
        elif head == "classification":
            num_classes = len(hf_config.get("id2label") or {}) or hf_config.get("num_labels", 2)
            dropout = hf_config.get("classifier_dropout") or hf_config.get(
                "classifier_dropout_prob", config.dropout
            )
            model = SequenceClassifier(backbone, num_classes=num_classes, dropout=float(dropout))
        else:
            model = SpanQuestionAnswerer(backbone)
    _assign(model, hf_config, tensors, directory)
    return model


def load_hf_weights(model, directory):
    """Copies a transformers BERT/ALBERT/RoBERTa checkpoint into an existing tfgpt `model`.

    `model` is a `Bert`, `Albert`, `Roberta`, one of their backbones, a
    `SequenceClassifier` or a `SpanQuestionAnswerer`. Raises ValueError, naming
    the field or tensor, when the checkpoint's architecture differs from the
    model's: another family, another shape in `config.json`, a tensor of
    another shape or a missing tensor.
    """
    hf_config, tensors = read_hf_checkpoint(directory)
    config = hf_encoder_config(hf_config, os.path.join(directory, "config.json"))
    family = _family_of(model)
    if hf_config["model_type"] != family:
        raise ValueError(
            f"{directory} holds a different architecture: the model is a "
            f"{type(model).__name__}, the checkpoint has "
            f"model_type={hf_config['model_type']!r}"
        )
    model_fields = _backbone_of(model).get_config()
    differences = [
        f"{name}: checkpoint {value!r}, model {model_fields[name]!r}"
        for name, value in dataclasses.asdict(config).items()
        if name != "dropout" and model_fields[name] != value
    ]
    if differences:
        raise ValueError(
            f"{directory} holds a different architecture than the model: "
            + "; ".join(differences)
        )
    _assign(model, hf_config, tensors, directory)
    return model


def _backbone_of(model):
    if isinstance(model, EncoderBackbone):
        return model
    if isinstance(model, (EncoderPretrainingModel, SequenceClassifier, SpanQuestionAnswerer)):
        return model.backbone
    raise ValueError(
        f"`model` must be a tfgpt {_titles()} model. "
        f"Received: model of type {type(model).__name__}"
    )


def _family_of(model):
    """The name of the encoder family of `model`'s backbone."""
    backbone = _backbone_of(model)
    return next(
        name
        for name in ENCODER_FAMILIES
        if isinstance(backbone, FAMILIES[name].backbone_class())
    )


# ---- Name mapping -----------------------------------------------------------


def _dense(hf_name, layer):
    """(name, variable, transpose) pairs of a torch Linear and a Keras Dense."""
    return [(f"{hf_name}.weight", layer.kernel, True), (f"{hf_name}.bias", layer.bias, False)]


def _norm(hf_name, layer):
    return [(f"{hf_name}.weight", layer.gamma, False), (f"{hf_name}.bias", layer.beta, False)]


def _embeddings(prefix, embeddings):
    return [
        (
            f"{prefix}embeddings.word_embeddings.weight",
            embeddings.token_embedding.embeddings,
            False,
        ),
        (
            f"{prefix}embeddings.position_embeddings.weight",
            embeddings.position_embedding.embeddings,
            False,
        ),
        (
            f"{prefix}embeddings.token_type_embeddings.weight",
            embeddings.segment_embedding.embeddings,
            False,
        ),
        *_norm(f"{prefix}embeddings.LayerNorm", embeddings.embedding_norm),
    ]


def _layer_map(hf_name, layer):
    """The pairs of a torch Linear or LayerNorm and a Keras Dense or LayerNorm."""
    return _norm(hf_name, layer) if isinstance(layer, LayerNorm) else _dense(hf_name, layer)


def _backbone_map(prefix, backbone, layout):
    pairs = _embeddings(prefix, backbone.embeddings)
    if backbone.embedding_projection is not None:
        pairs += _dense(
            f"{prefix}encoder.embedding_hidden_mapping_in", backbone.embedding_projection
        )
    for index, block in enumerate(backbone.blocks):
        hf_block = prefix + layout.block.format(index=index)
        for part, hf_name in zip(BLOCK_PARTS, layout.block_parts):
            layer = functools.reduce(getattr, part.split("."), block)
            pairs += _layer_map(f"{hf_block}.{hf_name}", layer)
    return pairs + _dense(f"{prefix}{layout.pooler}", backbone.pooler)


def _head_map(model, layout):
    if isinstance(model, EncoderPretrainingModel):
        head = model.masked_lm_head
        dense, norm = (f"{layout.masked_lm}.{name}" for name in layout.masked_lm_transform)
        pairs = [
            *_dense(dense, head.transform),
            *_norm(norm, head.transform_norm),
            (f"{layout.masked_lm}.bias", head.output_bias, False),
        ]
        if model.pair_task is not None:
            pair_head = getattr(model, model.pair_head_name)
            pairs += _dense(layout.pair_classifier, pair_head.classifier)
        return pairs
    if isinstance(model, SequenceClassifier):
        return _dense(layout.sequence_classifier, model.classification_head.classifier)
    if isinstance(model, SpanQuestionAnswerer):
        return _dense("qa_outputs", model.span_head.span_logits)
    return []


def _is_pooler(name, prefix):
    return name.startswith(f"{prefix}pooler.")


def _uses_pooler(model):
    """Whether `model`'s outputs depend on its pooler: transformers' models
    of the others (`*ForQuestionAnswering`, `RobertaForMaskedLM`) have none."""
    if isinstance(model, SpanQuestionAnswerer):
        return False
    return not isinstance(model, EncoderPretrainingModel) or model.pair_task is not None


def _checkpoint_prefix(model):
    """Where a checkpoint of `model` keeps the backbone: `bert.` etc., none for a base model."""
    return "" if isinstance(model, EncoderBackbone) else f"{_family_of(model)}."


def _tensor_map(model, prefix):
    """`(name, variable, transpose)` of every tensor `model` has in a checkpoint."""
    layout = _layout(_family_of(model))
    return _backbone_map(prefix, _backbone_of(model), layout) + _head_map(model, layout)


def _assign(model, hf_config, tensors, directory):
    """Copies `tensors` into `model`, checking that every shape matches."""
    family = _family_of(model)
    layout = _layout(family)
    if f"{family}.embeddings.word_embeddings.weight" in tensors:
        prefix = f"{family}."
    elif "embeddings.word_embeddings.weight" in tensors:
        prefix = ""
    else:
        raise ValueError(
            f"{directory}: no {family} embeddings found "
            f"(neither {family}.embeddings.word_embeddings.weight nor "
            "embeddings.word_embeddings.weight); not a transformers "
            f"{family} checkpoint"
        )
    pairs = _tensor_map(model, prefix)

    if isinstance(model, EncoderPretrainingModel):
        if hf_config.get("tie_word_embeddings", True) is False:
            raise ValueError(
                f"{directory}: the masked-LM decoder is not tied to the word "
                "embeddings (tie_word_embeddings=False); tfgpt's MaskedLMHead "
                "always ties them. Load with head=None for the backbone alone."
            )
        decoder = f"{layout.masked_lm}.decoder.weight"
        if decoder in tensors and not np.array_equal(
            tensors[decoder], tensors[f"{prefix}embeddings.word_embeddings.weight"]
        ):
            raise ValueError(
                f"{directory}: {decoder} differs from the word embeddings; "
                "tfgpt's MaskedLMHead needs them tied"
            )

    if not _uses_pooler(model):
        # *ForQuestionAnswering and RobertaForMaskedLM checkpoints have no
        # pooler; the model's outputs do not use it, so it keeps its
        # initial weights.
        pairs = [pair for pair in pairs if not _is_pooler(pair[0], prefix) or pair[0] in tensors]
    missing = [name for name, _, _ in pairs if name not in tensors]
    if missing:
        hint = ""
        if not isinstance(model, EncoderBackbone):
            hint = (
                " The checkpoint may lack this task's head: load_hf_encoder(..., "
                "head=None) builds the backbone alone."
            )
        raise ValueError(
            f"{directory}: {len(missing)} tensor(s) the {type(model).__name__} needs are "
            f"missing from the checkpoint, e.g. {', '.join(missing[:3])}.{hint}"
        )
    # Every shape is checked before the first assignment, so that a bad
    # checkpoint leaves an existing model untouched.
    for name, variable, transpose in pairs:
        expected = tuple(variable.shape[::-1]) if transpose else tuple(variable.shape)
        if tuple(tensors[name].shape) != expected:
            raise ValueError(
                f"{directory}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"the {type(model).__name__} expects {expected} (a checkpoint of a "
                "different architecture, or a config.json that does not match its weights)"
            )
    for name, variable, transpose in pairs:
        value = tensors[name].T if transpose else tensors[name]
        variable.assign(np.asarray(value, dtype=np.float32))

    used = {name for name, _, _ in pairs}
    # Tensors a checkpoint may hold that carry no information of their own:
    # a buffer, and the tied decoder's copies of the embeddings and the bias.
    redundant = ("position_ids", f"{layout.masked_lm}.decoder.bias",
                 f"{layout.masked_lm}.decoder.weight")
    unused = sorted(name for name in tensors if name not in used and not name.endswith(redundant))
    if unused and not isinstance(model, EncoderBackbone):
        warnings.warn(
            f"{directory}: {len(unused)} tensor(s) not used by the "
            f"{type(model).__name__}: {', '.join(unused[:5])}",
            stacklevel=3,
        )


# ---- Writing ----------------------------------------------------------------


def _architecture(model):
    """transformers' class name of `model`'s checkpoint, e.g. `RobertaForMaskedLM`."""
    layout = _layout(_family_of(model))
    if isinstance(model, EncoderBackbone):
        return f"{layout.classes}Model"
    if isinstance(model, SequenceClassifier):
        return f"{layout.classes}ForSequenceClassification"
    if isinstance(model, SpanQuestionAnswerer):
        return f"{layout.classes}ForQuestionAnswering"
    return f"{layout.classes}ForPreTraining" if model.pair_task else f"{layout.classes}ForMaskedLM"


def hf_config_from_encoder(model):
    """Returns the transformers `config.json` dict of a tfgpt encoder model.

    The inverse of `hf_encoder_config`. Raises ValueError, naming the field,
    for what transformers' encoders do not have: pre-layer-norm blocks, an
    activation outside `gelu`, `gelu_tanh`, `relu` (RoBERTa: `gelu` only),
    or RoBERTa's classification head.
    """
    family = _family_of(model)
    layout = _layout(family)
    config = _backbone_of(model).config
    if config.norm_first:
        raise ValueError(
            "transformers' encoders are post-layer-norm; a pre-layer-norm model has no "
            "equivalent. Received: norm_first=True"
        )
    if config.activation not in _ACTIVATIONS_TO_HF:
        raise ValueError(
            f"transformers' {family} has no activation {config.activation!r}. Received: "
            f"activation={config.activation!r}. Supported: {', '.join(_ACTIVATIONS_TO_HF)}"
        )
    hf_config = {
        "architectures": [_architecture(model)],
        "model_type": family,
        "vocab_size": config.vocabulary_size,
        "hidden_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_dim,
        "hidden_act": _ACTIVATIONS_TO_HF[config.activation],
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.dropout,
        "max_position_embeddings": config.max_sequence_length + config.first_position,
        "type_vocab_size": config.num_segments,
        "layer_norm_eps": config.layer_norm_epsilon,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        **{key: getattr(config, field) for field, (key, _) in layout.fields.items()},
    }
    for key, needed in layout.required.items():
        if hf_config.setdefault(key, needed) != needed:
            raise ValueError(
                f"transformers' {family} needs {key}={needed!r}. "
                f"Received: {key}={hf_config[key]!r} (activation={config.activation!r})"
            )
    if isinstance(model, SequenceClassifier):
        if layout.sequence_classifier is None:
            raise ValueError(
                f"{layout.classes}ForSequenceClassification's head has its own layout, which "
                "tfgpt does not write; save the backbone alone. Received: a SequenceClassifier "
                f"on a {type(model.backbone).__name__}"
            )
        hf_config["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_classes)}
        hf_config["label2id"] = {f"LABEL_{i}": i for i in range(model.num_classes)}
    return hf_config


def save_hf_encoder(model, directory):
    """Writes a tfgpt encoder as a transformers checkpoint directory.

    `config.json` (`hf_config_from_encoder`) and `model.safetensors` in
    float32, named as `save_pretrained` names them: a backbone as
    `{Bert,Albert,Roberta}Model`, `Bert`/`Albert` as `*ForPreTraining`,
    `Roberta` as `RobertaForMaskedLM` (without the pooler it does not use),
    a `SequenceClassifier` or `SpanQuestionAnswerer` as the task's model.
    The masked-LM decoder is tied, so only the embeddings are written.
    `load_hf_encoder` and transformers' `from_pretrained` read it back.

    Example:
    >>> save_hf_encoder(Roberta.from_preset("roberta-demo"), "out")  # doctest: +SKIP
    >>> transformers.RobertaForMaskedLM.from_pretrained("out")  # doctest: +SKIP
    """
    from safetensors.numpy import save_file

    hf_config = hf_config_from_encoder(model)
    prefix = _checkpoint_prefix(model)
    tensors = {}
    for name, variable, transpose in _tensor_map(model, prefix):
        if _is_pooler(name, prefix) and not _uses_pooler(model):
            continue
        value = np.asarray(variable.numpy(), np.float32)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(hf_config, file, indent=2, sort_keys=True)
        file.write("\n")
