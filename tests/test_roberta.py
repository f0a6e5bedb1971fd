"""RoBERTa: transformers parity both ways, the position rule, counts, config, errors.

Oracle: a randomly initialised transformers `RobertaForMaskedLM` /
`RobertaModel` (PyTorch, CPU; every weight, norms and biases too, given
noise), saved to tmp_path with `save_pretrained` and read by
tfgpt.convert_encoders; and tfgpt's models written by `save_hf_encoder` and
read by transformers' `from_pretrained`. The tolerance is 1e-5 on the
maximum absolute difference over every element in float32, pad positions
included (measured: below 2e-6 at these sizes).
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

from tests import model_contract as contract
from tests import numpy_encoder as ref
from tests.test_bert import bert_parameter_count
from tests.test_convert_encoders import max_abs, save_random
from tfgpt import Roberta, RobertaBackbone, RobertaConfig
from tfgpt.config import FAMILIES
from tfgpt.convert_encoders import (
    hf_config_from_encoder,
    load_hf_encoder,
    load_hf_weights,
    save_hf_encoder,
)

ATOL = 1e-5
# A tiny RoBERTa: distinct sizes, the released special ids (<s> 0, <pad> 1,
# </s> 2), one segment, epsilon 1e-5; 40 position rows hold 38 tokens.
VOCAB, LAYERS, HIDDEN, HEADS, INTERMEDIATE, POSITIONS = 97, 2, 32, 4, 44, 40
PAD = 1


def roberta_config(**overrides):
    return transformers.RobertaConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "intermediate_size": INTERMEDIATE,
            "max_position_embeddings": POSITIONS,
            "type_vocab_size": 1,
            "layer_norm_eps": 1e-5,
            "pad_token_id": PAD,
            **overrides,
        }
    )


def tiny_fields(**overrides):
    """The fields of the tfgpt model a `roberta_config()` checkpoint describes."""
    return dataclasses.asdict(
        RobertaConfig(
            **{
                "vocabulary_size": VOCAB,
                "num_layers": LAYERS,
                "num_heads": HEADS,
                "hidden_dim": HIDDEN,
                "intermediate_dim": INTERMEDIATE,
                "max_sequence_length": POSITIONS - PAD - 1,
                "dropout": 0.0,
                **overrides,
            }
        )
    )


def padded_batch(length, seed=1):
    """Three rows of `length` tokens: unpadded, right-padded, and pads inside
    and on the left, so that positions which skip pads differ from 0..T-1."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(3, VOCAB, (3, length))  # No special id by chance.
    token_ids[:, 0] = 0  # <s>
    token_ids[1, length - 3 :] = PAD
    token_ids[2, [0, 1, length // 2]] = PAD
    padding_mask = (token_ids != PAD).astype(np.int64)
    tfgpt_inputs = {"token_ids": token_ids.astype("int32"), "padding_mask": padding_mask}
    hf_inputs = {
        "input_ids": torch.tensor(token_ids),
        "attention_mask": torch.tensor(padding_mask),
    }
    return tfgpt_inputs, hf_inputs


# ---- transformers -> tfgpt ------------------------------------------------


@pytest.mark.parametrize("length", [9, 16])
def test_masked_lm_matches_transformers(tmp_path, length):
    reference = save_random(transformers.RobertaForMaskedLM, roberta_config(), tmp_path)
    model = load_hf_encoder(tmp_path, family="roberta")
    assert isinstance(model, Roberta)
    inputs, hf_inputs = padded_batch(length)
    outputs = model(inputs)
    with torch.no_grad():
        expected = reference(**hf_inputs, output_hidden_states=True)
    assert max_abs(outputs["sequence_output"], expected.hidden_states[-1]) < ATOL
    assert max_abs(outputs["mlm_logits"], expected.logits) < ATOL


def test_base_model_matches_transformers(tmp_path):
    # RobertaModel checkpoints have no "roberta." prefix and have a pooler.
    reference = save_random(transformers.RobertaModel, roberta_config(), tmp_path)
    model = load_hf_encoder(tmp_path, head=None)
    assert isinstance(model, RobertaBackbone)
    inputs, hf_inputs = padded_batch(11)
    with torch.no_grad():
        expected = reference(**hf_inputs)
    outputs = model(inputs)
    assert max_abs(outputs["sequence_output"], expected.last_hidden_state) < ATOL
    assert max_abs(outputs["pooled_output"], expected.pooler_output) < ATOL


def test_load_hf_weights_into_an_existing_model(tmp_path):
    save_random(transformers.RobertaForMaskedLM, roberta_config(), tmp_path)
    loaded = load_hf_encoder(tmp_path)
    model = Roberta(**tiny_fields())
    load_hf_weights(model, tmp_path)
    for mine, theirs in zip(model.weights, loaded.weights):
        if "pooler" not in mine.path:  # RobertaForMaskedLM has none.
            np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


# ---- tfgpt -> transformers ------------------------------------------------


def test_masked_lm_exported_to_transformers_reproduces_the_logits(tmp_path):
    model = Roberta(**tiny_fields())
    ref.randomize(model, seed=3)
    save_hf_encoder(model, tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["architectures"] == ["RobertaForMaskedLM"]
    assert hf_config["max_position_embeddings"] == POSITIONS
    assert hf_config["pad_token_id"] == PAD
    exported = transformers.RobertaForMaskedLM.from_pretrained(tmp_path).eval()
    inputs, hf_inputs = padded_batch(13)
    with torch.no_grad():
        expected = exported(**hf_inputs, output_hidden_states=True)
    outputs = model(inputs)
    assert max_abs(outputs["sequence_output"], expected.hidden_states[-1]) < ATOL
    assert max_abs(outputs["mlm_logits"], expected.logits) < ATOL
    # And back: every weight but the pooler, which RobertaForMaskedLM has not.
    reloaded = load_hf_encoder(tmp_path)
    for mine, theirs in zip(model.weights, reloaded.weights):
        if "pooler" not in mine.path:
            np.testing.assert_array_equal(mine.numpy(), theirs.numpy(), err_msg=mine.path)


def test_backbone_exported_to_transformers_reproduces_its_outputs(tmp_path):
    backbone = RobertaBackbone(**tiny_fields())
    ref.randomize(backbone, seed=4)
    save_hf_encoder(backbone, tmp_path)
    exported = transformers.RobertaModel.from_pretrained(tmp_path).eval()
    inputs, hf_inputs = padded_batch(10)
    with torch.no_grad():
        expected = exported(**hf_inputs)
    outputs = backbone(inputs)
    assert max_abs(outputs["sequence_output"], expected.last_hidden_state) < ATOL
    assert max_abs(outputs["pooled_output"], expected.pooler_output) < ATOL


# ---- The position rule ------------------------------------------------------


def test_positions_skip_pad_tokens_wherever_they_are():
    """A row's real tokens give the same outputs with its pads on the right,
    on the left or in between: positions count real tokens only."""
    model = RobertaBackbone(**tiny_fields())
    ref.randomize(model, seed=5)
    real = np.array([0, 17, 42, 8, 2], "int32")
    layouts = [[0, 1, 2, 3, 4, -1, -1], [-1, -1, 0, 1, 2, 3, 4], [0, -1, 1, 2, -1, 3, 4]]
    token_ids = np.full((3, 7), PAD, "int32")
    for row, layout in enumerate(layouts):
        for column, index in enumerate(layout):
            if index >= 0:
                token_ids[row, column] = real[index]
    outputs = model({"token_ids": token_ids, "padding_mask": token_ids != PAD})
    sequence = outputs["sequence_output"].numpy()
    rows = [sequence[row][token_ids[row] != PAD] for row in range(3)]  # (5, H) each
    np.testing.assert_allclose(rows[1], rows[0], atol=1e-5)
    np.testing.assert_allclose(rows[2], rows[0], atol=1e-5)


# ---- Published parameter counts -----------------------------------------

# transformers' RobertaModel (with its pooler) of the same shapes counts the
# same: roberta-base 124,645,632 ("125M"), roberta-large 355,359,744 ("355M");
# `bert_parameter_count` gives them from the shapes (514 position rows, one
# segment row).
ROBERTA_PARAMETERS = {"roberta-base": 124_645_632, "roberta-large": 355_359_744}


def masked_lm_head_parameter_count(config):
    """The masked-LM head: the transform H^2 + H, its layer norm 2H, the output bias V."""
    H, V = config.hidden_dim, config.vocabulary_size
    return (H * H + H) + 2 * H + V


@pytest.mark.parametrize("preset", ["roberta-base", "roberta-large"])
def test_parameter_counts_equal_transformers(preset):
    config = RobertaConfig.from_preset(preset)
    assert bert_parameter_count(config) == ROBERTA_PARAMETERS[preset]
    with contract.shapes_only():
        model = Roberta(**dataclasses.asdict(config))
    hf_config = transformers.RobertaConfig(**hf_config_from_encoder(model))
    assert hf_config.max_position_embeddings == 514 and hf_config.type_vocab_size == 1
    with torch.device("meta"):  # Shapes only: nothing is allocated.
        backbone = transformers.RobertaModel(hf_config)
        masked_lm = transformers.RobertaForMaskedLM(hf_config)
    pooler = config.hidden_dim**2 + config.hidden_dim
    assert model.backbone.count_params() == ROBERTA_PARAMETERS[preset]
    assert sum(p.numel() for p in backbone.parameters()) == ROBERTA_PARAMETERS[preset]
    # RobertaForMaskedLM leaves out the pooler that `Roberta` keeps for fine-tuning.
    assert sum(p.numel() for p in masked_lm.parameters()) == (
        model.count_params() - pooler
    ) == ROBERTA_PARAMETERS[preset] - pooler + masked_lm_head_parameter_count(config)


# ---- The model contract --------------------------------------------------


@pytest.mark.parametrize("cls", [Roberta, RobertaBackbone])
def test_model_contract(tmp_path, cls):
    # Every field off its default (pad_id too), so that a dropped one shows.
    config = RobertaConfig(
        **contract.tiny_fields(
            dropout=0.1, activation="relu", layer_norm_epsilon=1e-6, num_segments=2, pad_id=3
        )
    )
    inputs = {
        "token_ids": np.array([[0, 5, 3, 6, 3], [3, 0, 7, 8, 2]], "int32"),
        "segment_ids": np.array([[0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], "int32"),
        "padding_mask": np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], "int32"),
    }
    contract.run_encoder_contract(
        cls,
        config,
        inputs,
        np.array([[1, 3], [4, 2]], "int32"),
        tmp_path,
        bert_parameter_count(config),
        masked_lm_head_parameter_count(config),
        prepare=lambda model: ref.randomize(model, seed=11),
    )


def test_get_config_round_trip():
    config = RobertaConfig(**tiny_fields(pad_id=4, num_segments=2))
    model = Roberta(**dataclasses.asdict(config))
    restored = Roberta.from_config(model.get_config())
    assert restored.config == config
    assert restored.get_config() == model.get_config()
    assert RobertaConfig(**dataclasses.asdict(config)) == config
    rows = restored.backbone.embeddings.position_embedding.embeddings.shape[0]
    assert rows == config.max_sequence_length + 4 + 1


def test_presets():
    contract.check_presets(FAMILIES["roberta"], unknown_field="embedding_dim")
    assert FAMILIES["roberta"].resolve_task("auto") == "mlm"
    with pytest.raises(ValueError, match=r"--task mlm\+nsp does not train a roberta"):
        FAMILIES["roberta"].resolve_task("mlm+nsp")


# ---- Bad input ----------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    contract.BAD_COMMON_FIELDS
    + [
        ({"pad_id": -1}, r"non-negative integer.*pad_id=-1"),
        ({"vocabulary_size": 10, "pad_id": 10}, r"must be an id.*pad_id=10, vocabulary_size=10"),
    ],
)
def test_bad_config_raises(overrides, message):
    contract.check_bad_config(Roberta, tiny_fields(), overrides, message)


def test_config_that_does_not_match_the_tensors_raises(tmp_path):
    save_random(transformers.RobertaForMaskedLM, roberta_config(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["max_position_embeddings"] = 30
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = (
        r"tensor roberta\.embeddings\.position_embeddings\.weight has shape \(40, 32\), "
        r"the Roberta expects \(30, 32\)"
    )
    with pytest.raises(ValueError, match=message):
        load_hf_encoder(tmp_path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model_type", "xlm-roberta", r"RoBERTa checkpoint\. Received: model_type='xlm-roberta'"),
        ("hidden_act", "relu", r"needs hidden_act='gelu'\. Received: hidden_act='relu'"),
        ("pad_token_id", None, r"pad_id=None"),
        ("max_position_embeddings", 2, r"max_position_embeddings=2, pad_token_id=1"),
    ],
)
def test_unsupported_checkpoint_raises(tmp_path, field, value, message):
    save_random(transformers.RobertaForMaskedLM, roberta_config(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_hf_encoder(tmp_path)


def test_checkpoint_of_another_family_raises(tmp_path):
    save_random(transformers.RobertaForMaskedLM, roberta_config(), tmp_path)
    with pytest.raises(ValueError, match=r"expected a bert checkpoint.*model_type='roberta'"):
        load_hf_encoder(tmp_path, family="bert")
    with pytest.raises(ValueError, match=r"head='classification', model_type='roberta'"):
        load_hf_encoder(tmp_path, head="classification")


def test_export_of_what_transformers_lacks_raises(tmp_path):
    with pytest.raises(ValueError, match=r"needs hidden_act='gelu'.*activation='relu'"):
        save_hf_encoder(Roberta(**tiny_fields(activation="relu")), tmp_path)
    with pytest.raises(ValueError, match=r"post-layer-norm.*norm_first=True"):
        save_hf_encoder(Roberta(**tiny_fields(norm_first=True)), tmp_path)


def test_fine_tuning_refuses_roberta_for_now(tmp_path):
    from tfgpt.finetuning.task_models import describe_init

    save_random(transformers.RobertaForMaskedLM, roberta_config(), tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'roberta' model; fine-tuning needs a BERT"):
        describe_init(str(tmp_path))


# ---- Tokenizer ----------------------------------------------------------


def test_byte_pair_tokenizer_reads_a_roberta_vocabulary(tmp_path):
    """RoBERTa's tokenizer is GPT-2's byte-level BPE with <s> <pad> </s> <unk>
    first and <mask> last: tfgpt's BytePairTokenizer gives transformers'
    RobertaTokenizer's ids for text; the <s> ... </s> around them are the caller's."""
    from tfgpt.tokenizers.byte_pair_tokenizer import BytePairTokenizer, bytes_to_unicode

    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at", "o w", "Ġ l", "Ġl ow", "e r"]
    vocabulary = {token: index for index, token in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for token in [*bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in merges)]:
        vocabulary.setdefault(token, len(vocabulary))
    vocabulary["<mask>"] = len(vocabulary)
    (tmp_path / "vocab.json").write_text(json.dumps(vocabulary))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    reference = transformers.RobertaTokenizer(
        str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    )
    assert (reference.bos_token_id, reference.pad_token_id, reference.eos_token_id) == (0, PAD, 2)
    text = "the cat lower, Éte  the\tcat 12 ok"
    ids = BytePairTokenizer.from_directory(tmp_path).encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert [0, *ids, 2] == reference.encode(text)
