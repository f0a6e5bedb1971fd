"""Load BERT and ALBERT checkpoints in the transformers layout into tfgpt models.

A transformers checkpoint directory holds `config.json` and
`model.safetensors` (or shards listed in `model.safetensors.index.json`).
`load_hf_encoder` builds the matching tfgpt model from `config.json` and
copies every tensor into it; `load_hf_weights` fills a model you built.
Nothing is downloaded: the directory must already be on disk, e.g. from
`transformers.AutoModel.from_pretrained(...).save_pretrained(directory)`.

Layout differences handled here:
- torch `Linear.weight` is (out, in); a Keras `Dense.kernel` is (in, out).
- BERT's masked-LM decoder is tied to the word embeddings and its bias is
  `cls.predictions.bias`; tfgpt's `MaskedLMHead` likewise reads the
  backbone's token embedding and owns `output_bias`.
- ALBERT stores `num_hidden_groups` shared layers under
  `albert_layer_groups.{g}.albert_layers.0`; they fill `backbone.blocks[g]`.

Example:
>>> model = load_hf_encoder("checkpoints/bert-base-uncased")  # doctest: +SKIP
>>> model({"token_ids": ids})["mlm_logits"]  # doctest: +SKIP
"""

import dataclasses
import json
import os
import struct
import warnings

import numpy as np

from tfgpt.config import AlbertConfig, BertConfig
from tfgpt.models.albert import Albert, AlbertBackbone
from tfgpt.models.bert import Bert, BertBackbone
from tfgpt.models.sequence_classifier import SequenceClassifier
from tfgpt.models.span_question_answerer import SpanQuestionAnswerer

HEADS = ("pretraining", "classification", "question_answering", None)

# transformers' activation names (transformers/activations.py ACT2FN) that
# equal a tfgpt activation.
_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # Widened to float32 below; NumPy has no bfloat16.
    "I64": np.int64,
    "I32": np.int32,
}


# ---- Files ----------------------------------------------------------------


def read_safetensors(path):
    """Returns the tensors of one `.safetensors` file as {name: np.ndarray}.

    The format is an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the raw little-endian data
    (https://github.com/huggingface/safetensors). Read directly so that
    loading a checkpoint needs neither torch nor the safetensors package.
    bfloat16 tensors are widened to float32.
    """
    try:
        with open(path, "rb") as file:
            header_length = struct.unpack("<Q", file.read(8))[0]
            header = json.loads(file.read(header_length))
    except (OSError, struct.error, ValueError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_length)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}. "
                f"Supported: {', '.join(_SAFETENSORS_DTYPES)}"
            )
        begin, end = info["data_offsets"]
        if end > data.size:
            raise ValueError(
                f"{path}: tensor {name!r} lies beyond the end of the file (truncated?)"
            )
        array = np.frombuffer(data[begin:end], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array.reshape(info["shape"])
    return tensors


def read_hf_checkpoint(directory):
    """Returns `(config, tensors)`: the parsed `config.json` and every tensor."""
    config_path = os.path.join(directory, "config.json")
    try:
        with open(config_path) as file:
            config = json.load(file)
    except OSError as error:
        raise ValueError(
            f"Not a transformers checkpoint directory: cannot read {config_path} "
            f"({error.strerror})"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: malformed JSON ({error})") from None

    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(single):
        return config, read_safetensors(single)
    if os.path.exists(index):
        with open(index) as file:
            shards = sorted(set(json.load(file)["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(read_safetensors(os.path.join(directory, shard)))
        return config, tensors
    found = sorted(os.listdir(directory))
    raise ValueError(
        f"No model.safetensors (or model.safetensors.index.json) in {directory}; "
        f"found: {found}. Only safetensors checkpoints are read (a pytorch_model.bin "
        "can be re-saved with transformers' save_pretrained, which writes safetensors)."
    )


# ---- config.json -> tfgpt config --------------------------------------------


def hf_encoder_config(hf_config, source="config.json"):
    """Returns the `BertConfig` or `AlbertConfig` described by a transformers config dict.

    Raises ValueError, naming the field and its value, for a model type other
    than bert/albert and for features tfgpt's encoders do not have (relative
    positions, decoders, ALBERT's inner groups).
    """
    model_type = hf_config.get("model_type")
    if model_type not in ("bert", "albert"):
        raise ValueError(
            f"{source}: expected a BERT or ALBERT checkpoint. Received: model_type={model_type!r}"
        )
    unsupported = {
        "position_embedding_type": ("absolute", None),
        "is_decoder": (False, None),
        "add_cross_attention": (False, None),
    }
    if model_type == "albert":
        unsupported["inner_group_num"] = (1, None)
    for field, allowed in unsupported.items():
        if hf_config.get(field) not in allowed:
            raise ValueError(
                f"{source}: unsupported architecture, tfgpt's {model_type} needs "
                f"{field}={allowed[0]!r}. Received: {field}={hf_config.get(field)!r}"
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
    try:
        if model_type == "bert":
            return BertConfig(**fields)
        return AlbertConfig(
            **fields,
            embedding_dim=hf_config["embedding_size"],
            num_groups=hf_config.get("num_hidden_groups", 1),
        )
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


# ---- Building and loading ---------------------------------------------------


def load_hf_encoder(directory, family=None, head="pretraining"):
    """Builds the tfgpt model a transformers BERT/ALBERT checkpoint describes and loads it.

    Args:
        directory: str. A directory with `config.json` and `model.safetensors`.
        family: str or None. `"bert"` or `"albert"` to insist on one; a
            checkpoint of the other raises ValueError. None accepts both.
        head: str or None. Which model to build:
            `"pretraining"`: `Bert`/`Albert` with masked-LM and NSP/SOP
                heads (from a `*ForPreTraining` checkpoint);
            `"classification"`: `SequenceClassifier` (from a
                `*ForSequenceClassification` checkpoint; `num_classes` from
                `id2label`);
            `"question_answering"`: `SpanQuestionAnswerer` (from a
                `*ForQuestionAnswering` checkpoint);
            None: the backbone alone, from any of them.

    Returns:
        The model, in float32.
    """
    if head not in HEADS:
        raise ValueError(f"`head` must be one of {HEADS}. Received: head={head!r}")
    if family not in ("bert", "albert", None):
        raise ValueError(f"`family` must be 'bert', 'albert' or None. Received: family={family!r}")
    hf_config, tensors = read_hf_checkpoint(directory)
    config = hf_encoder_config(hf_config, os.path.join(directory, "config.json"))
    model_type = hf_config["model_type"]
    if family is not None and model_type != family:
        raise ValueError(
            f"{directory} holds a different architecture: expected a {family} checkpoint. "
            f"Received: model_type={model_type!r}"
        )
    is_bert = model_type == "bert"
    fields = dataclasses.asdict(config)
    if head == "pretraining":
        model = (Bert if is_bert else Albert)(**fields)
    else:
        backbone = (BertBackbone if is_bert else AlbertBackbone)(**fields)
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
    """Copies a transformers BERT/ALBERT checkpoint into an existing tfgpt `model`.

    `model` is a `Bert`, `Albert`, `BertBackbone`, `AlbertBackbone`,
    `SequenceClassifier` or `SpanQuestionAnswerer`. Raises ValueError, naming
    the field or tensor, when the checkpoint's architecture differs from the
    model's: another family, another shape in `config.json`, a tensor of
    another shape or a missing tensor.
    """
    hf_config, tensors = read_hf_checkpoint(directory)
    config = hf_encoder_config(hf_config, os.path.join(directory, "config.json"))
    backbone = _backbone_of(model)
    family = "bert" if isinstance(backbone, BertBackbone) else "albert"
    if hf_config["model_type"] != family:
        raise ValueError(
            f"{directory} holds a different architecture: the model is a "
            f"{type(model).__name__}, the checkpoint has "
            f"model_type={hf_config['model_type']!r}"
        )
    model_fields = backbone.get_config()
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
    if isinstance(model, (BertBackbone, AlbertBackbone)):
        return model
    if isinstance(model, (Bert, Albert, SequenceClassifier, SpanQuestionAnswerer)):
        return model.backbone
    raise ValueError(
        "`model` must be a tfgpt BERT or ALBERT model. "
        f"Received: model of type {type(model).__name__}"
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


def _bert_backbone_map(prefix, backbone):
    pairs = _embeddings(prefix, backbone.embeddings)
    for index, block in enumerate(backbone.blocks):
        layer = f"{prefix}encoder.layer.{index}"
        pairs += [
            *_dense(f"{layer}.attention.self.query", block.attention.query),
            *_dense(f"{layer}.attention.self.key", block.attention.key),
            *_dense(f"{layer}.attention.self.value", block.attention.value),
            *_dense(f"{layer}.attention.output.dense", block.attention.output_projection),
            *_norm(f"{layer}.attention.output.LayerNorm", block.attention_norm),
            *_dense(f"{layer}.intermediate.dense", block.feedforward_intermediate),
            *_dense(f"{layer}.output.dense", block.feedforward_output),
            *_norm(f"{layer}.output.LayerNorm", block.feedforward_norm),
        ]
    return pairs + _dense(f"{prefix}pooler.dense", backbone.pooler)


def _albert_backbone_map(prefix, backbone):
    pairs = _embeddings(prefix, backbone.embeddings)
    pairs += _dense(f"{prefix}encoder.embedding_hidden_mapping_in", backbone.embedding_projection)
    for group, block in enumerate(backbone.blocks):
        layer = f"{prefix}encoder.albert_layer_groups.{group}.albert_layers.0"
        pairs += [
            *_dense(f"{layer}.attention.query", block.attention.query),
            *_dense(f"{layer}.attention.key", block.attention.key),
            *_dense(f"{layer}.attention.value", block.attention.value),
            *_dense(f"{layer}.attention.dense", block.attention.output_projection),
            *_norm(f"{layer}.attention.LayerNorm", block.attention_norm),
            *_dense(f"{layer}.ffn", block.feedforward_intermediate),
            *_dense(f"{layer}.ffn_output", block.feedforward_output),
            *_norm(f"{layer}.full_layer_layer_norm", block.feedforward_norm),
        ]
    return pairs + _dense(f"{prefix}pooler", backbone.pooler)


def _head_map(model):
    if isinstance(model, Bert):
        head = model.masked_lm_head
        return [
            *_dense("cls.predictions.transform.dense", head.transform),
            *_norm("cls.predictions.transform.LayerNorm", head.transform_norm),
            ("cls.predictions.bias", head.output_bias, False),
            *_dense("cls.seq_relationship", model.next_sentence_head.classifier),
        ]
    if isinstance(model, Albert):
        head = model.masked_lm_head
        return [
            *_dense("predictions.dense", head.transform),
            *_norm("predictions.LayerNorm", head.transform_norm),
            ("predictions.bias", head.output_bias, False),
            *_dense("sop_classifier.classifier", model.sentence_order_head.classifier),
        ]
    if isinstance(model, SequenceClassifier):
        return _dense("classifier", model.classification_head.classifier)
    if isinstance(model, SpanQuestionAnswerer):
        return _dense("qa_outputs", model.span_head.span_logits)
    return []


def _is_pooler(name, prefix):
    return name.startswith(f"{prefix}pooler.")


# Tensors a checkpoint may hold that carry no information of their own.
_REDUNDANT_SUFFIXES = ("position_ids", "predictions.decoder.bias")


def _assign(model, hf_config, tensors, directory):
    """Copies `tensors` into `model`, checking that every shape matches."""
    backbone = _backbone_of(model)
    is_bert = isinstance(backbone, BertBackbone)
    family = "bert" if is_bert else "albert"
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
    backbone_map = _bert_backbone_map if is_bert else _albert_backbone_map
    pairs = backbone_map(prefix, backbone) + _head_map(model)

    if isinstance(model, (Bert, Albert)):
        if hf_config.get("tie_word_embeddings", True) is False:
            raise ValueError(
                f"{directory}: the masked-LM decoder is not tied to the word "
                "embeddings (tie_word_embeddings=False); tfgpt's MaskedLMHead "
                "always ties them. Load with head=None for the backbone alone."
            )
        decoder = "cls.predictions.decoder.weight" if is_bert else "predictions.decoder.weight"
        if decoder in tensors and not np.array_equal(
            tensors[decoder], tensors[f"{prefix}embeddings.word_embeddings.weight"]
        ):
            raise ValueError(
                f"{directory}: {decoder} differs from the word embeddings; "
                "tfgpt's MaskedLMHead needs them tied"
            )

    if isinstance(model, SpanQuestionAnswerer):
        # *ForQuestionAnswering checkpoints have no pooler; the span head
        # does not use it, so it keeps its initial weights.
        pairs = [pair for pair in pairs if not _is_pooler(pair[0], prefix) or pair[0] in tensors]
    missing = [name for name, _, _ in pairs if name not in tensors]
    if missing:
        hint = ""
        if isinstance(model, (Bert, Albert, SequenceClassifier, SpanQuestionAnswerer)):
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
    unused = sorted(
        name
        for name in tensors
        if name not in used
        and not name.endswith(_REDUNDANT_SUFFIXES)
        and not name.endswith("predictions.decoder.weight")
    )
    if unused and isinstance(model, (Bert, Albert, SequenceClassifier, SpanQuestionAnswerer)):
        warnings.warn(
            f"{directory}: {len(unused)} tensor(s) not used by the "
            f"{type(model).__name__}: {', '.join(unused[:5])}",
            stacklevel=3,
        )
