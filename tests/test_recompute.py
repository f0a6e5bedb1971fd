"""Activation recomputation (`--recompute`): same gradients, really recomputed."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfgpt import GPT
from tfgpt.layers.transformer_block import TransformerBlock, set_recompute
from tfgpt.models import BertBackbone, SequenceClassifier
from tfgpt.training.train_step import cross_entropy


def _tiny_gpt(dropout):
    keras.utils.set_random_seed(3)
    return GPT(vocabulary_size=23, num_layers=3, num_heads=2, hidden_dim=8,
               intermediate_dim=12, max_sequence_length=8, dropout=dropout)


def _two_steps_of_gradients(recompute, dropout, jit_compile):
    """Loss and gradients of two consecutive calls (the second one shows that
    the dropout RNG state ends where it would without recomputation)."""
    model = _tiny_gpt(dropout)
    assert set_recompute(model, recompute) == 3
    rng = np.random.default_rng(1)
    inputs = rng.integers(0, 23, (2, 5)).astype("int32")
    targets = rng.integers(0, 23, (2, 5)).astype("int32")

    @tf.function(jit_compile=jit_compile)
    def gradients():
        with tf.GradientTape() as tape:
            loss = cross_entropy(targets, model(inputs, training=True))
        return loss, tape.gradient(loss, [v.value for v in model.trainable_variables])

    results = []
    for _ in range(2):
        loss, grads = gradients()
        results.append((float(loss), [tf.convert_to_tensor(g).numpy() for g in grads]))
    return results


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recomputation_leaves_losses_and_gradients_unchanged(dropout, jit_compile):
    plain = _two_steps_of_gradients(False, dropout, jit_compile)
    recomputed = _two_steps_of_gradients(True, dropout, jit_compile)
    for (loss, grads), (loss_r, grads_r) in zip(plain, recomputed):
        assert loss_r == pytest.approx(loss, rel=1e-6)
        for g, g_r in zip(grads, grads_r):
            np.testing.assert_allclose(g_r, g, atol=1e-6)
    if dropout:
        assert plain[0][0] != plain[1][0]  # dropout was live: the two calls differ


def test_blocks_run_again_in_the_backward_pass(monkeypatch):
    calls = []
    apply = TransformerBlock._apply
    monkeypatch.setattr(TransformerBlock, "_apply",
                        lambda self, *args: calls.append(self.name) or apply(self, *args))
    inputs = tf.constant([[1, 2, 3, 4]])
    for recompute, expected_per_block in [(False, 1), (True, 2)]:
        model = _tiny_gpt(0.0)
        set_recompute(model, recompute)
        calls.clear()
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(inputs, training=True))
        tape.gradient(loss, model.trainable_variables)
        assert len(calls) == 3 * expected_per_block, recompute
    # Inference and cached decoding never recompute.
    calls.clear()
    model(inputs, training=False)
    assert len(calls) == 3


def test_recompute_is_not_part_of_the_architecture():
    model = _tiny_gpt(0.0)
    set_recompute(model, True)
    assert "recompute" not in model.blocks[0].get_config()
    assert "recompute" not in model.get_config()


def test_a_task_model_recomputes_its_backbones_blocks():
    backbone = BertBackbone(vocabulary_size=23, num_layers=3, num_heads=2, hidden_dim=8,
                            intermediate_dim=12, max_sequence_length=8)
    classifier = SequenceClassifier(backbone, num_classes=2)
    assert set_recompute(classifier, True) == 3
    assert all(block.recompute for block in backbone.blocks)
    assert set_recompute(classifier, False) == 3
    assert not any(block.recompute for block in backbone.blocks)
