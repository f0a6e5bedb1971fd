"""BERT: NumPy oracles, padding, heads, parameter counts, saving, errors."""


import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import model_contract as contract
from tests import numpy_encoder as ref
from tfgpt import (
    Bert,
    BertBackbone,
    BertConfig,
    SequenceClassifier,
    SpanQuestionAnswerer,
)
from tfgpt.config import FAMILIES
from tfgpt.layers import ClassificationHead, SelfAttention, TransformerBlock

# Distinct sizes so that no two dimensions can be confused for each other.
BATCH, LENGTH = 2, 7
VOCAB, LAYERS, HEADS = contract.VOCAB, contract.LAYERS, contract.HEADS
HIDDEN, INTERMEDIATE = contract.HIDDEN, contract.INTERMEDIATE


def tiny_config(**overrides):
    return contract.tiny_fields(**{"dropout": 0.0, **overrides})


def tiny_inputs(seed=0, length=LENGTH):
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, VOCAB, (BATCH, length)).astype("int32")
    # A sentence pair in row 0, a single padded sentence in row 1.
    segment_ids = np.zeros((BATCH, length), "int32")
    segment_ids[0, length // 2 :] = 1
    padding_mask = np.ones((BATCH, length), "int32")
    padding_mask[1, length - 2 :] = 0
    return {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask}


# ---- Oracles ------------------------------------------------------------


def test_self_attention_matches_numpy_reference_with_padding():
    layer = SelfAttention(hidden_dim=HIDDEN, num_heads=HEADS)
    ref.check_layer(layer, ref.attention, tiny_inputs()["padding_mask"], seed=1, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_encoder_block_matches_numpy_reference(norm_first, activation):
    block = TransformerBlock(
        HIDDEN,
        HEADS,
        INTERMEDIATE,
        attention="bidirectional",
        activation=activation,
        norm_first=norm_first,
        layer_norm_epsilon=1e-12,
    )
    ref.check_layer(block, ref.block, tiny_inputs()["padding_mask"], seed=3, atol=1e-4)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-ln", "pre-ln"])
def test_bert_matches_numpy_reference(norm_first):
    model = Bert(**tiny_config(norm_first=norm_first))
    ref.randomize(model, seed=5)
    ref.check_pretraining_model(model, tiny_inputs(), ref.bert_backbone)


def test_mask_positions_select_rows_of_the_full_logits():
    model = Bert(**tiny_config())
    inputs = tiny_inputs()
    full = model(inputs)["mlm_logits"].numpy()  # (B, T, V)
    positions = np.array([[1, 4, 0], [2, 2, 3]], "int32")  # (B, P), P=3 != T
    selected = model({**inputs, "mask_positions": positions})["mlm_logits"].numpy()
    assert selected.shape == (BATCH, 3, VOCAB)
    expected = np.take_along_axis(full, positions[..., None], axis=1)  # (B, P, V)
    np.testing.assert_allclose(selected, expected, atol=1e-5)


def test_masked_lm_output_is_tied_to_the_token_embedding():
    model = Bert(**tiny_config())
    names = [weight.path for weight in model.weights]
    assert sum("token_embedding" in name for name in names) == 1
    assert not any(
        tuple(weight.shape) == (HIDDEN, VOCAB) for weight in model.masked_lm_head.weights
    )


def test_padding_tokens_do_not_change_real_positions():
    model = BertBackbone(**tiny_config())
    ref.randomize(model, seed=6)
    inputs = tiny_inputs()
    changed = {key: value.copy() for key, value in inputs.items()}
    changed["token_ids"][1, -2:] = (changed["token_ids"][1, -2:] + 5) % VOCAB
    before = model(inputs)["sequence_output"].numpy()
    after = model(changed)["sequence_output"].numpy()
    np.testing.assert_allclose(after[1, :-2], before[1, :-2], atol=1e-6)
    np.testing.assert_array_equal(after[0], before[0])
    # Without the mask the same change is visible everywhere.
    unmasked = {key: value for key, value in changed.items() if key != "padding_mask"}
    assert np.abs(model(unmasked)["sequence_output"].numpy()[1, 0] - before[1, 0]).max() > 1e-3


def test_bare_token_ids_mean_one_segment_and_no_padding():
    model = BertBackbone(**tiny_config())
    ref.randomize(model, seed=7)
    token_ids = tiny_inputs()["token_ids"]
    explicit = {
        "token_ids": token_ids,
        "segment_ids": np.zeros_like(token_ids),
        "padding_mask": np.ones_like(token_ids),
    }
    np.testing.assert_allclose(
        model(token_ids)["sequence_output"].numpy(),
        model(explicit)["sequence_output"].numpy(),
        atol=1e-6,
    )


def test_segments_change_the_output():
    model = BertBackbone(**tiny_config())
    inputs = tiny_inputs()
    swapped = {**inputs, "segment_ids": 1 - inputs["segment_ids"]}
    assert np.abs(
        model(inputs)["sequence_output"].numpy() - model(swapped)["sequence_output"].numpy()
    ).max() > 1e-4


def test_dropout_is_active_only_in_training():
    model = Bert(**tiny_config(dropout=0.3))
    inputs = tiny_inputs()
    np.testing.assert_array_equal(
        model(inputs)["mlm_logits"].numpy(), model(inputs)["mlm_logits"].numpy()
    )
    assert not np.allclose(
        model(inputs, training=True)["mlm_logits"].numpy(), model(inputs)["mlm_logits"].numpy()
    )


def test_task_models_match_their_heads_on_the_backbone():
    backbone = BertBackbone(**tiny_config())
    ref.randomize(backbone, seed=8)
    inputs = tiny_inputs()
    sequence, pooled = ref.bert_backbone(
        inputs["token_ids"], inputs["segment_ids"], inputs["padding_mask"], backbone
    )
    classifier = SequenceClassifier(backbone, num_classes=5)
    ref.randomize(classifier.classification_head, seed=9)
    np.testing.assert_allclose(
        classifier(inputs).numpy(),
        ref.classifier(pooled, classifier.classification_head),
        atol=1e-4,
    )
    answerer = SpanQuestionAnswerer(backbone)
    ref.randomize(answerer.span_head, seed=10)
    span = ref.dense(sequence, answerer.span_head.span_logits)  # (B, T, 2)
    outputs = answerer(inputs)
    np.testing.assert_allclose(outputs["start_logits"].numpy(), span[..., 0], atol=1e-4)
    np.testing.assert_allclose(outputs["end_logits"].numpy(), span[..., 1], atol=1e-4)


def test_compiled_function_with_unknown_length_matches_eager():
    model = Bert(**tiny_config())
    inputs = tiny_inputs()
    signature = {
        key: tf.TensorSpec((None, None), tf.int32)
        for key in ("token_ids", "segment_ids", "padding_mask")
    }
    compiled = tf.function(lambda x: model(x)["mlm_logits"], input_signature=[signature])
    np.testing.assert_allclose(
        compiled(inputs).numpy(), model(inputs)["mlm_logits"].numpy(), atol=1e-5
    )


# ---- Published parameter counts -----------------------------------------


def bert_parameter_count(config):
    """BERT's parameters from its architecture (Devlin et al. 2019, Section 3).

    Embeddings V*H + P*H + S*H and their layer norm 2H; per layer the four
    H x H attention projections with biases 4(H^2 + H), two layer norms 4H,
    the feed-forward H*I + I + I*H + H; the pooler H^2 + H; and with
    pre-LN blocks the final layer norm 2H. P is the position table's rows:
    `max_sequence_length`, plus `pad_id + 1` for RoBERTa (`first_position`).
    """
    V, H, I = config.vocabulary_size, config.hidden_dim, config.intermediate_dim
    P = config.max_sequence_length + config.first_position
    S, L = config.num_segments, config.num_layers
    embeddings = (V + P + S) * H + 2 * H
    layer = 4 * (H * H + H) + 4 * H + (H * I + I) + (I * H + H)
    final_norm = 2 * H if config.norm_first else 0
    return embeddings + L * layer + (H * H + H) + final_norm


def pretraining_heads_parameter_count(config):
    """Bert's heads: the masked-LM transform H^2 + H, its layer norm 2H, the
    output bias V and the next-sentence classifier 2H + 2."""
    H, V = config.hidden_dim, config.vocabulary_size
    return (H * H + H) + 2 * H + V + (2 * H + 2)


# transformers' BertModel (with pooler) of the same shapes counts the same.
BERT_PARAMETERS = {"bert-base": 109_482_240, "bert-large": 335_141_888}
# Bert adds its pretraining heads (`pretraining_heads_parameter_count`).
BERT_PRETRAINING_PARAMETERS = {"bert-base": 110_106_428, "bert-large": 336_226_108}


@pytest.mark.parametrize("preset", contract.fast_then_slow(["bert-base"], ["bert-large"]))
def test_bert_parameter_counts(preset):
    contract.check_encoder_parameter_counts(
        Bert,
        preset,
        BERT_PARAMETERS[preset],
        BERT_PRETRAINING_PARAMETERS[preset],
        bert_parameter_count,
        pretraining_heads_parameter_count,
    )


@pytest.mark.parametrize("preset", ["bert-base", "bert-large"])
def test_bert_parameter_counts_equal_transformers(preset):
    contract.check_transformers_parameter_counts(
        "Bert",
        BertConfig.from_preset(preset),
        BERT_PARAMETERS[preset],
        BERT_PRETRAINING_PARAMETERS[preset],
    )


# ---- The model contract --------------------------------------------------


@pytest.mark.parametrize("cls", [Bert, BertBackbone])
@pytest.mark.parametrize(
    "overrides",
    [
        {"norm_first": False, "activation": "gelu_tanh"},
        {"dropout": 0.1, "activation": "relu", "norm_first": True, "num_segments": 3},
    ],
    ids=["post-ln", "every-field-changed"],
)
def test_model_contract(tmp_path, cls, overrides):
    config = BertConfig(**tiny_config(layer_norm_epsilon=1e-6, **overrides))
    contract.run_encoder_contract(
        cls,
        config,
        tiny_inputs(),
        np.array([[1, 2], [0, 4]], "int32"),
        tmp_path,
        bert_parameter_count(config),
        pretraining_heads_parameter_count(config),
        prepare=lambda model: ref.randomize(model, seed=11),
    )


def test_presets():
    contract.check_presets(FAMILIES["bert"], unknown_field="embedding_dim")


@pytest.mark.parametrize("task", ["classification", "question_answering"])
def test_task_model_keras_file_round_trip(tmp_path, task):
    backbone = BertBackbone(**tiny_config())
    if task == "classification":
        model = SequenceClassifier(backbone, num_classes=3, dropout=0.2)
    else:
        model = SpanQuestionAnswerer(backbone)
    ref.randomize(model, seed=12)
    inputs = tiny_inputs()
    path = tmp_path / "task.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored) is type(model)
    assert isinstance(restored.backbone, BertBackbone)
    expected = keras.tree.flatten(model(inputs))
    for actual, wanted in zip(keras.tree.flatten(restored(inputs)), expected):
        np.testing.assert_array_equal(actual.numpy(), wanted.numpy())


# ---- Bad input ----------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    contract.BAD_COMMON_FIELDS + [({"num_segments": 0}, r"num_segments=0")],
)
def test_bad_config_raises(overrides, message):
    contract.check_bad_config(Bert, tiny_config(), overrides, message)


def test_unknown_input_key_raises():
    model = Bert(**tiny_config())
    with pytest.raises(ValueError, match=r"input_ids"):
        model({"input_ids": tiny_inputs()["token_ids"]})
    with pytest.raises(ValueError, match=r"mask_positions"):
        model.backbone({**tiny_inputs(), "mask_positions": np.zeros((BATCH, 1), "int32")})


def test_sequence_longer_than_position_table_raises():
    model = BertBackbone(**tiny_config(max_sequence_length=6))
    with pytest.raises(ValueError, match=r"sequence_length=7.*max_sequence_length=6"):
        model(tiny_inputs(length=7))


def test_task_model_needs_an_encoder_backbone():
    with pytest.raises(ValueError, match=r"BertBackbone or an AlbertBackbone.*type Bert"):
        SequenceClassifier(Bert(**tiny_config()), num_classes=2)
    with pytest.raises(ValueError, match=r"num_classes=1"):
        ClassificationHead(num_classes=1)


@pytest.mark.parametrize("family", ["bert", "albert"])
def test_tf_train_checkpoint_saves_and_restores_every_weight(tmp_path, family):
    """tf.train.Checkpoint (the trainers' format) must reach the blocks too."""
    import tensorflow as tf

    from tfgpt.models.albert import Albert
    from tfgpt.models.bert import Bert

    cls, preset = (Bert, "bert-demo") if family == "bert" else (Albert, "albert-demo")
    keras.utils.set_random_seed(1)
    model = cls.from_preset(preset, num_layers=2)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    saved = [name for name, _ in tf.train.list_variables(path) if name.startswith("model/")]
    assert len(saved) == len(model.weights)
    keras.utils.set_random_seed(2)
    fresh = cls.from_preset(preset, num_layers=2)
    tf.train.Checkpoint(model=fresh).restore(path).assert_existing_objects_matched()
    for original, restored in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(original.numpy(), restored.numpy(), err_msg=original.path)
