"""Converted transformers BERT/ALBERT checkpoints reproduce the reference outputs.

Oracle: a randomly initialised transformers model (PyTorch, CPU), saved to
tmp_path with `save_pretrained`, loaded by tfgpt.convert_encoders; and a
tfgpt model written by `save_hf_encoder`, loaded by `from_pretrained`.
RoBERTa's are in tests/test_roberta.py. The
tolerance is on the maximum absolute difference over every element, in
float32: 1e-4 for hidden states, pooled outputs and logits (measured: below
2e-6 at these sizes).

torch and transformers are test requirements (requirements-test.txt): the
module fails, not skips, without them.
"""

import json

import numpy as np
import pytest
import torch
import transformers

from tests import model_contract as contract
from tests import numpy_encoder as ref
from tfgpt import Bert, BertBackbone, SequenceClassifier, SpanQuestionAnswerer
from tfgpt.config import ENCODER_FAMILIES, FAMILIES, FINETUNING_FAMILIES
from tfgpt.convert_encoders import (
    EncoderLayout,
    load_hf_encoder,
    load_hf_weights,
    save_hf_encoder,
)
from tfgpt.hf_files import read_safetensors
from tfgpt.models import encoder_families

ATOL = 1e-4
# The tiny sizes of tests/model_contract.py, so that `contract.tiny_fields()`
# builds the model a `bert_config()` checkpoint describes.
VOCAB, HIDDEN, HEADS = contract.VOCAB, contract.HIDDEN, contract.HEADS
INTERMEDIATE, MAX_LENGTH = contract.INTERMEDIATE, contract.MAX_LENGTH


def bert_config(**overrides):
    return transformers.BertConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": contract.LAYERS,
            "num_attention_heads": HEADS,
            "intermediate_size": INTERMEDIATE,
            "max_position_embeddings": MAX_LENGTH,
            "type_vocab_size": 2,
            **overrides,
        }
    )


def albert_config(**overrides):
    return transformers.AlbertConfig(
        **{
            "vocab_size": VOCAB,
            "embedding_size": 8,
            "hidden_size": HIDDEN,
            "num_hidden_layers": 4,
            "num_attention_heads": HEADS,
            "intermediate_size": INTERMEDIATE,
            "max_position_embeddings": MAX_LENGTH,
            "type_vocab_size": 2,
            **overrides,
        }
    )


def save_random(model_class, config, directory, seed=0):
    """Saves a transformers model whose every weight (norms, biases too) is random."""
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    model.eval()
    model.save_pretrained(directory)
    return model


def example_inputs(batch=2, length=7):
    rng = np.random.default_rng(1)
    token_ids = rng.integers(0, VOCAB, (batch, length))
    segment_ids = np.zeros((batch, length), np.int64)
    segment_ids[0, 3:] = 1
    padding_mask = np.ones((batch, length), np.int64)
    padding_mask[1, 5:] = 0
    tfgpt_inputs = {
        "token_ids": token_ids.astype("int32"),
        "segment_ids": segment_ids.astype("int32"),
        "padding_mask": padding_mask.astype("int32"),
    }
    hf_inputs = {
        "input_ids": torch.tensor(token_ids),
        "token_type_ids": torch.tensor(segment_ids),
        "attention_mask": torch.tensor(padding_mask),
    }
    return tfgpt_inputs, hf_inputs


def max_abs(a, b):
    return float(np.abs(np.asarray(a) - b.detach().numpy()).max())


# ---- Oracles ------------------------------------------------------------


def check_pretraining_matches_transformers(tmp_path, hf_class, hf_config, family, hf_pair_logits):
    """The converted pretraining model's four outputs equal transformers'."""
    reference = save_random(hf_class, hf_config, tmp_path)
    model = load_hf_encoder(tmp_path, family=family)
    assert isinstance(model, FAMILIES[family].pretraining_class())
    inputs, hf_inputs = example_inputs()
    outputs = model(inputs)
    with torch.no_grad():
        expected = reference(**hf_inputs, output_hidden_states=True)
        pooled = getattr(reference, family)(**hf_inputs).pooler_output
    assert max_abs(outputs["sequence_output"], expected.hidden_states[-1]) < ATOL
    assert max_abs(outputs["pooled_output"], pooled) < ATOL
    assert max_abs(outputs["mlm_logits"], expected.prediction_logits) < ATOL
    pair_logits = outputs[f"{model.pair_task}_logits"]
    assert max_abs(pair_logits, getattr(expected, hf_pair_logits)) < ATOL
    return model


def test_bert_for_pretraining_matches_transformers(tmp_path):
    check_pretraining_matches_transformers(
        tmp_path, transformers.BertForPreTraining, bert_config(), "bert", "seq_relationship_logits"
    )


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_hidden_groups": 2, "hidden_act": "gelu"}],
    ids=["one-group", "two-groups-gelu"],
)
def test_albert_for_pretraining_matches_transformers(tmp_path, overrides):
    model = check_pretraining_matches_transformers(
        tmp_path, transformers.AlbertForPreTraining, albert_config(**overrides), "albert", "sop_logits"
    )
    assert model.backbone.num_groups == overrides.get("num_hidden_groups", 1)


# Each family's name, transformers' class prefix and tiny config.
FAMILY_PARAMETERS = pytest.mark.parametrize(
    "family, hf_prefix, make_config",
    [("bert", "Bert", bert_config), ("albert", "Albert", albert_config)],
)


@FAMILY_PARAMETERS
def test_backbone_alone_from_a_base_model_checkpoint(tmp_path, family, hf_prefix, make_config):
    # BertModel/AlbertModel checkpoints have no "bert."/"albert." prefix.
    reference = save_random(getattr(transformers, f"{hf_prefix}Model"), make_config(), tmp_path)
    model = load_hf_encoder(tmp_path, head=None)
    assert isinstance(model, FAMILIES[family].backbone_class())
    inputs, hf_inputs = example_inputs()
    with torch.no_grad():
        expected = reference(**hf_inputs)
    outputs = model(inputs)
    assert max_abs(outputs["sequence_output"], expected.last_hidden_state) < ATOL
    assert max_abs(outputs["pooled_output"], expected.pooler_output) < ATOL


@FAMILY_PARAMETERS
def test_fine_tuned_checkpoints_match_transformers(tmp_path, family, hf_prefix, make_config):
    classifier_reference = save_random(
        getattr(transformers, f"{hf_prefix}ForSequenceClassification"),
        make_config(num_labels=3),
        tmp_path / "cls",
    )
    # *ForQuestionAnswering has no pooler and a 2-wide qa_outputs layer.
    qa_reference = save_random(
        getattr(transformers, f"{hf_prefix}ForQuestionAnswering"),
        make_config(num_labels=2),
        tmp_path / "qa",
    )
    classifier = load_hf_encoder(tmp_path / "cls", head="classification")
    answerer = load_hf_encoder(tmp_path / "qa", head="question_answering")
    assert isinstance(classifier, SequenceClassifier) and classifier.num_classes == 3
    assert isinstance(answerer, SpanQuestionAnswerer)
    inputs, hf_inputs = example_inputs()
    with torch.no_grad():
        expected_logits = classifier_reference(**hf_inputs).logits
        expected_spans = qa_reference(**hf_inputs)
    assert max_abs(classifier(inputs), expected_logits) < ATOL
    spans = answerer(inputs)
    assert max_abs(spans["start_logits"], expected_spans.start_logits) < ATOL
    assert max_abs(spans["end_logits"], expected_spans.end_logits) < ATOL


@FAMILY_PARAMETERS
def test_pretraining_model_exported_to_transformers_reproduces_it(tmp_path, family, hf_prefix,
                                                                  make_config):
    fields = contract.tiny_fields(**({"embedding_dim": 8} if family == "albert" else {}))
    model = FAMILIES[family].pretraining_class()(**fields)
    ref.randomize(model, seed=5)
    save_hf_encoder(model, tmp_path)
    exported = getattr(transformers, f"{hf_prefix}ForPreTraining").from_pretrained(tmp_path)
    inputs, hf_inputs = example_inputs()
    with torch.no_grad():
        expected = exported.eval()(**hf_inputs)
    outputs = model(inputs)
    assert max_abs(outputs["mlm_logits"], expected.prediction_logits) < ATOL
    pair_logits = expected.seq_relationship_logits if family == "bert" else expected.sop_logits
    assert max_abs(outputs[f"{model.pair_task}_logits"], pair_logits) < ATOL


def test_classifier_exported_to_transformers_reproduces_it(tmp_path):
    model = SequenceClassifier(BertBackbone(**contract.tiny_fields()), num_classes=3)
    ref.randomize(model, seed=6)
    save_hf_encoder(model, tmp_path)
    exported = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    inputs, hf_inputs = example_inputs()
    with torch.no_grad():
        expected = exported(**hf_inputs).logits
    assert max_abs(model(inputs), expected) < ATOL


def test_load_hf_weights_into_an_existing_model(tmp_path):
    save_random(transformers.BertForPreTraining, bert_config(), tmp_path)
    loaded = load_hf_encoder(tmp_path)
    model = Bert(**contract.tiny_fields())
    load_hf_weights(model, tmp_path)
    for mine, theirs in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_read_safetensors_matches_the_safetensors_package(tmp_path):
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    tensors = {
        "float32": torch.randn(3, 4),
        "float16": torch.randn(5).half(),
        "bfloat16": torch.randn(2, 3).bfloat16(),
        "int64": torch.arange(6).reshape(2, 3),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    read = read_safetensors(tmp_path / "t.safetensors")
    reference = load_file(tmp_path / "t.safetensors")
    for name in ("float32", "float16", "int64"):
        np.testing.assert_array_equal(read[name], reference[name])
    np.testing.assert_array_equal(read["bfloat16"], tensors["bfloat16"].float().numpy())


# ---- The families' folders ---------------------------------------------


def test_every_encoder_family_is_its_folders_and_listed_once():
    declared = encoder_families.ENCODER_FAMILIES
    assert ENCODER_FAMILIES == tuple(declared) == ("bert", "albert", "roberta")
    assert FINETUNING_FAMILIES == ("bert", "albert")
    for name, family in declared.items():
        # The trainers' presets are the folder's, each completed with the config's defaults.
        assert list(FAMILIES[name].presets) == list(family.presets)
        for preset, fields in family.presets.items():
            assert FAMILIES[name].presets[preset] == {**FAMILIES[name].presets[preset], **fields}
        assert FAMILIES[name].config_class.__name__ == family.config_class
        assert FAMILIES[name].tasks == family.tasks
        assert FAMILIES[name].backbone_class().__module__ == f"tfgpt.models.{name}.models"
        assert isinstance(family.converter().LAYOUT, EncoderLayout)


# ---- Bad checkpoints ----------------------------------------------------


def test_checkpoint_of_the_other_family_raises(tmp_path):
    save_random(transformers.AlbertForPreTraining, albert_config(), tmp_path)
    with pytest.raises(ValueError, match=r"expected a bert checkpoint.*model_type='albert'"):
        load_hf_encoder(tmp_path, family="bert")
    bert = Bert(**contract.tiny_fields())
    with pytest.raises(ValueError, match=r"model is a Bert.*model_type='albert'"):
        load_hf_weights(bert, tmp_path)


def test_checkpoint_of_another_shape_raises(tmp_path):
    save_random(transformers.BertForPreTraining, bert_config(), tmp_path)
    wider = Bert(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=HEADS,
        hidden_dim=24,
        intermediate_dim=INTERMEDIATE,
        max_sequence_length=MAX_LENGTH,
    )
    message = r"num_layers: checkpoint 3, model 2.*hidden_dim: checkpoint 12, model 24"
    with pytest.raises(ValueError, match=message):
        load_hf_weights(wider, tmp_path)


def test_config_that_does_not_match_the_tensors_raises(tmp_path):
    save_random(transformers.BertForPreTraining, bert_config(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 24
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = (
        r"tensor bert\.encoder\.layer\.0\.intermediate\.dense\.weight has shape \(20, 12\), "
        r"the Bert expects \(24, 12\)"
    )
    with pytest.raises(ValueError, match=message):
        load_hf_encoder(tmp_path)


def test_missing_head_raises_and_names_the_tensor(tmp_path):
    save_random(transformers.BertModel, bert_config(), tmp_path)
    with pytest.raises(ValueError, match=r"missing.*cls\.predictions.*head=None"):
        load_hf_encoder(tmp_path, head="pretraining")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("inner_group_num", 2, r"inner_group_num=2"),
        ("hidden_act", "silu", r"hidden_act='silu'"),
        ("model_type", "deberta", r"model_type='deberta'"),
        ("num_hidden_groups", 3, r"num_layers=4, num_groups=3"),
    ],
)
def test_unsupported_architecture_raises(tmp_path, field, value, message):
    save_random(transformers.AlbertForPreTraining, albert_config(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_hf_encoder(tmp_path)


def test_directory_without_readable_weights_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(bert_config().to_dict()))
    with pytest.raises(FileNotFoundError, match=r"No weights in .*model\.safetensors.*"
                       r"pytorch_model\.bin.*found: \['config.json'\]"):
        load_hf_encoder(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: not a readable PyTorch"):
        load_hf_encoder(tmp_path)
    with pytest.raises(ValueError, match=r"cannot read .*config\.json"):
        load_hf_encoder(tmp_path / "elsewhere")
