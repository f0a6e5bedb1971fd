"""FusedAdamW against keras.optimizers.AdamW and a NumPy AdamW.

The fused kernel forms `1 - beta` in float32 from float32 `beta`, Keras
rounds the double `1 - beta` (0.10000002 vs 0.1 for beta_1 = 0.9), so
moments and weights agree with Keras to about 1e-7 relative, not bit for
bit; the weight decay alone, in a tf.function, agrees bit for bit.
"""

import contextlib
import copy
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.launch import REPO, run
from tfgpt.checkpoint import RunCheckpointer
from tfgpt.checkpoint.state import Entry
from tfgpt.config import TrainConfig
from tfgpt.optim.fused_adamw import FusedAdamW
from tfgpt.optim.optimizers import (
    NO_DECAY_PATTERN,
    learning_rate_schedule,
    make_optimizer,
)
from tfgpt.optim.schedules import WarmupDecay
from tfgpt.parallel import LocalDistribution
from tfgpt.parallel.zero import replicated_optimizer_variables, slot_variables
from tfgpt.training.train_step import TrainStep

# make_optimizer's AdamW settings, with a warmup so the rate changes per step.
SETTINGS = dict(beta_1=0.9, beta_2=0.95, epsilon=1e-8, weight_decay=0.1, global_clipnorm=1.0)
SHAPES = {"kernel": (3, 7), "bias": (7,), "gamma": (5,), "embeddings": (11, 2), "dense_kernel": (2, 4, 5)}
STEPS = 5
# Moments and weights: 1e-6 relative, with an absolute floor at 1e-6 of the
# largest magnitude (a moment can pass through zero).
RTOL = 1e-6


def _schedule():
    return WarmupDecay(3e-2, warmup_steps=2, total_steps=10, decay="cosine", final_ratio=0.1)


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.normal(size=shape).astype("float32"), name=name)
            for name, shape in SHAPES.items()]


def _gradients(steps=STEPS, seed=1, scale=1.0):
    rng = np.random.default_rng(seed)
    return [[(scale * rng.normal(size=shape)).astype("float32") for shape in SHAPES.values()]
            for _ in range(steps)]


def _optimizer(cls, **overrides):
    optimizer = cls(learning_rate=_schedule(), **{**SETTINGS, **overrides})
    optimizer.exclude_from_weight_decay(var_names=[NO_DECAY_PATTERN])
    return optimizer


def _run(cls, gradients, jit_compile=False, **overrides):
    variables = _variables()
    optimizer = _optimizer(cls, **overrides)
    optimizer.build(variables)
    apply = tf.function(lambda g: optimizer.apply(g, variables), jit_compile=jit_compile)
    for step_gradients in gradients:
        apply([tf.constant(g) for g in step_gradients])
    return optimizer, variables


def _assert_close(actual, expected, name, rtol=RTOL):
    floor = rtol * max(np.abs(expected).max(), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=floor, err_msg=name)


def _numpy_adamw(weights, gradients, decays, learning_rates, beta_1=0.9, beta_2=0.95,
                 epsilon=1e-8, weight_decay=0.1, clip_norm=1.0):
    """Textbook AdamW in float64: global-norm clipping, decoupled decay, Adam."""
    w = [x.astype("float64") for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, (step_gradients, lr) in enumerate(zip(gradients, learning_rates), start=1):
        g = [x.astype("float64") for x in step_gradients]
        norm = np.sqrt(sum((x * x).sum() for x in g))
        g = [x * min(1.0, clip_norm / norm) for x in g]
        for i in range(len(w)):
            if decays[i]:
                w[i] = w[i] - w[i] * weight_decay * lr
            m[i] = beta_1 * m[i] + (1 - beta_1) * g[i]
            v[i] = beta_2 * v[i] + (1 - beta_2) * g[i] ** 2
            alpha = lr * np.sqrt(1 - beta_2**t) / (1 - beta_1**t)
            w[i] = w[i] - alpha * m[i] / (np.sqrt(v[i]) + epsilon)
    return w, m, v


@pytest.mark.parametrize("jit_compile", [False, True])
def test_steps_equal_keras_adamw_and_numpy_adamw(jit_compile):
    gradients = _gradients()
    fused, fused_variables = _run(FusedAdamW, gradients, jit_compile)
    reference, reference_variables = _run(keras.optimizers.AdamW, gradients, jit_compile)

    assert int(fused.iterations) == int(reference.iterations) == STEPS
    # The same slots under the same names (after the optimizer's own name).
    assert fused.name.startswith("adam_w")
    assert ([v.path.split("/", 1)[1] for v in fused.variables]
            == [v.path.split("/", 1)[1] for v in reference.variables])
    for a, b in zip(fused.variables, reference.variables):
        _assert_close(a.numpy(), b.numpy(), a.path)
    for a, b in zip(fused_variables, reference_variables):
        _assert_close(a.numpy(), b.numpy(), a.path)
    # Not bit for bit (1 - beta rounds differently, see the module docstring),
    # but the moments differ in the last bits only.
    assert any(not np.array_equal(a.numpy(), b.numpy())
               for a, b in zip(fused._momentums, reference._momentums))

    rates = [float(_schedule()(step)) for step in range(STEPS)]
    decays = [name in ("kernel", "dense_kernel") for name in SHAPES]
    weights, momentums, velocities = _numpy_adamw(
        [v.numpy() for v in _variables()], gradients, decays, rates)
    for variable, expected in zip(fused_variables, weights):
        np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=variable.path)
    for slots, expected in ((fused._momentums, momentums), (fused._velocities, velocities)):
        for slot, value in zip(slots, expected):
            np.testing.assert_allclose(slot.numpy(), value, rtol=1e-5,
                                       atol=1e-5 * np.abs(value).max(), err_msg=slot.path)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_weight_decay_alone_is_keras_bit_for_bit(jit_compile):
    # Zero gradients leave the Adam step at zero: only the decay moves weights.
    gradients = _gradients(scale=0.0)
    _, fused = _run(FusedAdamW, gradients, jit_compile, global_clipnorm=None)
    _, reference = _run(keras.optimizers.AdamW, gradients, jit_compile, global_clipnorm=None)
    for a, b, initial in zip(fused, reference, _variables()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
        decayed = not np.array_equal(a.numpy(), initial.numpy())
        assert decayed == (a.name in ("kernel", "dense_kernel")), a.path


@pytest.mark.parametrize(
    "overrides",
    [dict(use_ema=True, ema_momentum=0.9), dict(gradient_accumulation_steps=2), dict(amsgrad=True),
     dict(clipnorm=0.5, global_clipnorm=None)],
    ids=["ema", "accumulation", "amsgrad", "clipnorm"],
)
def test_other_adamw_arguments_equal_keras(overrides):
    gradients = _gradients()
    fused, fused_variables = _run(FusedAdamW, gradients, **overrides)
    reference, reference_variables = _run(keras.optimizers.AdamW, gradients, **overrides)
    assert int(fused.iterations) == int(reference.iterations)
    for a, b in zip(fused.variables + fused_variables, reference.variables + reference_variables):
        _assert_close(a.numpy(), b.numpy(), a.path)


def test_other_dtypes_take_keras_own_step():
    gradients = _gradients()
    results = []
    for cls in (FusedAdamW, keras.optimizers.AdamW):
        variables = [keras.Variable(v.numpy(), dtype="float64", name=v.name) for v in _variables()]
        optimizer = _optimizer(cls)
        for step_gradients in gradients:
            optimizer.apply([tf.constant(g, tf.float64) for g in step_gradients], variables)
        results.append([v.numpy() for v in variables + optimizer.variables])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_sliced_gradients_take_keras_own_step():
    # Keras's Adam on slices with a repeated row squares the slices before
    # summing them: not the dense step, and kept as Keras computes it.
    # (Without clipping, which would make them dense first.)
    rng = np.random.default_rng(2)
    values = rng.normal(size=(3, 2)).astype("float32")
    sliced = tf.IndexedSlices(tf.constant(values), tf.constant([4, 0, 4]), tf.constant([11, 2]))
    results = []
    for cls in (FusedAdamW, keras.optimizers.AdamW):
        variable = keras.Variable(np.ones((11, 2), "float32"), name="embeddings")
        optimizer = _optimizer(cls, global_clipnorm=None)
        for _ in range(2):
            optimizer.apply([sliced], [variable])
        results.append([variable.numpy(), *(v.numpy() for v in optimizer.variables)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("source, target", [(keras.optimizers.AdamW, FusedAdamW),
                                            (FusedAdamW, keras.optimizers.AdamW)])
def test_checkpoints_restore_across_the_two_classes(source, target, tmp_path):
    gradients = _gradients(steps=6)
    variables = _variables()
    optimizer = _optimizer(source)
    optimizer.build(variables)
    for step_gradients in gradients[:3]:
        optimizer.apply([tf.constant(g) for g in step_gradients], variables)

    def entries(variables, optimizer):  # as a run keys them: by name, moments beside
        parts = [Entry(f"v{index}", v, tuple(v.shape)) for index, v in enumerate(variables)]
        for name, moments in slot_variables(optimizer).items():
            parts += [Entry(f"v{index}/{name}", m, tuple(m.shape))
                      for index, m in enumerate(moments)]
        return parts + [Entry(f"optimizer/{v.name}", v, tuple(v.shape))
                        for v in replicated_optimizer_variables(optimizer)]

    RunCheckpointer(str(tmp_path), LocalDistribution(),
                    lambda: entries(variables, optimizer)).save(3)

    restored_variables = _variables(seed=9)
    restored = _optimizer(target)
    restored.build(restored_variables)
    loader = RunCheckpointer(str(tmp_path), LocalDistribution(),
                             lambda: entries(restored_variables, restored))
    assert loader.restore_latest()
    assert int(restored.iterations) == 3
    for a, b in zip(restored.variables + restored_variables, optimizer.variables + variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    # Both continue alike (within the rounding of `1 - beta`).
    for step_gradients in gradients[3:]:
        optimizer.apply([tf.constant(g) for g in step_gradients], variables)
        restored.apply([tf.constant(g) for g in step_gradients], restored_variables)
    for a, b in zip(restored.variables + restored_variables, optimizer.variables + variables):
        _assert_close(a.numpy(), b.numpy(), a.path)


def test_config_round_trips():
    optimizer = _optimizer(FusedAdamW)
    config = optimizer.get_config()
    # from_config deserializes the schedule in place: hand it a copy.
    assert FusedAdamW.from_config(copy.deepcopy(config)).get_config() == config
    serialized = keras.saving.serialize_keras_object(optimizer)
    assert type(keras.saving.deserialize_keras_object(serialized)) is FusedAdamW


def test_make_optimizer_builds_it_for_adamw_only():
    config = TrainConfig(data="d", weight_decay=0.1, gradient_clip_norm=1.0)
    optimizer = make_optimizer(config)
    assert type(optimizer) is FusedAdamW
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.9, 0.95, 1e-8)
    assert (optimizer.weight_decay, optimizer.global_clipnorm) == (0.1, 1.0)
    wrapped = make_optimizer(TrainConfig(data="d", mixed_precision="float16"))
    assert type(wrapped.inner_optimizer) is FusedAdamW
    assert type(make_optimizer(TrainConfig(data="d", optimizer="lamb"))) is not FusedAdamW


def _make_optimizer(config, fused):
    """make_optimizer's optimizer, or the same built from keras.optimizers.AdamW."""
    if fused:
        return make_optimizer(config)
    optimizer = keras.optimizers.AdamW(
        learning_rate=learning_rate_schedule(config), weight_decay=config.weight_decay,
        global_clipnorm=config.gradient_clip_norm, beta_1=0.9, beta_2=0.95, epsilon=1e-8)
    optimizer.exclude_from_weight_decay(var_names=[NO_DECAY_PATTERN])
    return optimizer


def _tiny_gpt(**overrides):
    from tfgpt import GPT

    keras.utils.set_random_seed(3)
    return GPT(vocabulary_size=23, num_layers=3, num_heads=2, hidden_dim=8,
               intermediate_dim=12, max_sequence_length=8, **overrides)


@pytest.mark.parametrize("xla", [False, True])
def test_train_step_equals_keras_adamw(xla):
    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, 23, (2, 5)).astype("int32"),
                rng.integers(0, 23, (2, 5)).astype("int32")) for _ in range(3)]
    results = []
    config = TrainConfig(data="d", warmup_steps=2, steps=10, gradient_clip_norm=0.5)
    for fused in (True, False):
        model = _tiny_gpt()
        optimizer = _make_optimizer(config, fused)
        optimizer.build(model.trainable_variables)
        step = TrainStep(model, optimizer, LocalDistribution(), xla=xla)
        losses = [float(step(batch)["loss"]) for batch in batches]
        assert int(optimizer.iterations) == len(batches)
        results.append((losses, [v.numpy() for v in model.trainable_variables]))
    (fused_losses, fused), (keras_losses, reference) = results
    np.testing.assert_allclose(fused_losses, keras_losses, rtol=1e-6)
    # Looser than for given gradients: the last-bit differences feed back
    # through two more forward and backward passes, and some gradients are
    # zero up to rounding (the attention keys' bias), so those weights and
    # all moments are rounding noise in both. The same atol as XLA against
    # graph mode in test_train_step_xla.
    for a, b in zip(fused, reference):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_float16_loss_scaling_skips_then_applies_like_keras():
    rng = np.random.default_rng(0)
    batch = (rng.integers(0, 23, (2, 5)).astype("int32"), rng.integers(0, 23, (2, 5)).astype("int32"))
    results = []
    try:
        for cls in (FusedAdamW, keras.optimizers.AdamW):
            model = _tiny_gpt(dtype="mixed_float16")
            inner = _optimizer(cls)
            optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**60)
            optimizer.build(model.trainable_variables)
            before = [v.numpy() for v in model.trainable_variables]
            step = TrainStep(model, optimizer, LocalDistribution())
            step(batch)  # overflows: skipped
            assert int(inner.iterations) == 0
            for a, v in zip(before, model.trainable_variables):
                np.testing.assert_array_equal(a, v.numpy())
            optimizer.dynamic_scale.assign(2.0**10)
            step(batch)
            assert int(inner.iterations) == 1
            results.append([v.numpy() for v in model.trainable_variables])
    finally:
        keras.config.set_dtype_policy("float32")
    for a, b in zip(*results):
        _assert_close(a, b, "float16")


@pytest.mark.distributed
def test_mirrored_replicas_update_their_own_slots_like_keras(tmp_path):
    """Two MirroredStrategy replicas on logical CPUs (a fresh process)."""
    code, output = run([sys.executable, REPO / "tests" / "worker_scripts" / "fused_adamw_mirrored.py"])
    assert code == 0, output
    assert "replicas identical, equal to keras AdamW" in output, output


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fit_through_the_horovod_wrapper_equals_keras_adamw(policy):
    from tests.test_keras_horovod import FakeDistribution
    from tfgpt.parallel.keras_horovod import DistributedOptimizer

    rng = np.random.default_rng(5)
    inputs = rng.integers(0, 23, (6, 5)).astype("int32")
    targets = rng.integers(0, 23, (6, 5)).astype("int32")
    config = TrainConfig(data="d", warmup_steps=2, steps=10, gradient_clip_norm=0.5)
    results = []
    try:
        for fused in (True, False):
            keras.config.set_dtype_policy(policy)
            model = _tiny_gpt()
            inner = _make_optimizer(config, fused)
            # The fake's mean with a rank of zero gradients halves them.
            model.compile(optimizer=DistributedOptimizer(inner, FakeDistribution()),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=False)
            history = model.fit(inputs, targets, batch_size=2, epochs=1, shuffle=False, verbose=0)
            assert int(inner.iterations) == 3
            assert {v.dtype for v in model.trainable_variables} == {"float32"}
            results.append((history.history["loss"], [v.numpy() for v in model.trainable_variables]))
    finally:
        keras.config.set_dtype_policy("float32")
    (fused_loss, fused), (keras_loss, reference) = results
    np.testing.assert_allclose(fused_loss, keras_loss, rtol=1e-5)
    for a, b in zip(fused, reference):
        np.testing.assert_allclose(a, b, atol=2e-6)


def _apply_steps(optimizer, variables, gradients, given_norms=None):
    @tf.function
    def apply(step_gradients, norm):
        if norm is None:
            optimizer.apply(step_gradients, variables)
        else:
            with optimizer.given_gradient_norm(norm):
                optimizer.apply(step_gradients, variables)

    for index, step_gradients in enumerate(gradients):
        norm = None if given_norms is None else tf.constant(given_norms[index], tf.float32)
        apply([tf.constant(g) for g in step_gradients], norm)


@pytest.mark.parametrize("overrides", [{}, dict(global_clipnorm=None), dict(weight_decay=0.0)],
                         ids=["clip-and-decay", "no-clip", "no-decay"])
def test_one_pass_kernel_is_the_tensorflow_kernels_bit_for_bit(overrides):
    # Clip scale, decay and Adam step in one TfgptResourceApplyAdamW pass,
    # against the same optimizer with the kernels off: Keras's clip, then
    # ResourceApplyGradientDescent and ResourceApplyAdam, three passes.
    from tfgpt import kernels

    assert kernels.library() is not None, kernels.unavailable_reason()
    gradients = _gradients(scale=3.0)  # norms above the clip of 1
    results = []
    for off in (False, True):
        variables = _variables()
        optimizer = _optimizer(FusedAdamW, **overrides)
        optimizer.build(variables)
        with kernels.disabled() if off else contextlib.nullcontext():
            _apply_steps(optimizer, variables, gradients)
            graph = tf.function(lambda g: optimizer.apply(g, variables)).get_concrete_function(
                [tf.TensorSpec(g.shape) for g in gradients[0]]).graph
        types = {op.type for op in graph.get_operations()}
        assert ("TfgptResourceApplyAdamW" in types) == (not off)
        assert ("ResourceApplyAdam" in types) == off
        results.append([v.numpy() for v in variables + optimizer.variables])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    # And both are AdamW: equal to Keras's to the rounding of `1 - beta`.
    _, reference = _run(keras.optimizers.AdamW, gradients, **overrides)
    for a, b in zip(results[0], [v.numpy() for v in reference]):
        _assert_close(a, b, "keras")


def test_given_gradient_norm_replaces_the_computed_one():
    # Told norms of 1-8x the true ones (a different factor each step, which
    # Adam's scale invariance does not cancel), the clip scales by those:
    # Keras's AdamW, unclipped, on gradients scaled by min(1, clip / given).
    gradients = _gradients(scale=3.0)
    factors = [1.0, 4.0, 1.0, 8.0, 2.0]
    norms = [f * np.sqrt(sum((g.astype("float64") ** 2).sum() for g in step))
             for f, step in zip(factors, gradients)]
    variables = _variables()
    optimizer = _optimizer(FusedAdamW)
    optimizer.build(variables)
    _apply_steps(optimizer, variables, gradients, given_norms=norms)
    clipped = [[g * np.float32(min(1.0, 1.0 / norm)) for g in step]
               for step, norm in zip(gradients, norms)]
    _, reference = _run(keras.optimizers.AdamW, clipped, global_clipnorm=None)
    for a, b in zip(variables, reference):
        _assert_close(a.numpy(), b.numpy(), a.path)
    # Without it, the optimizer computes the norm itself.
    _, plain = _run(FusedAdamW, gradients)
    assert not np.allclose(plain[0].numpy(), variables[0].numpy(), rtol=1e-4)


def test_one_pass_kernel_rejects_bad_inputs():
    from tfgpt import kernels

    apply = kernels.library().tfgpt_resource_apply_adam_w
    w, m, v = (tf.Variable(tf.zeros((3, 2))) for _ in range(3))
    scalars = dict(lr=1e-3, beta1=0.9, beta2=0.95, epsilon=1e-8, beta1_power=0.9,
                   beta2_power=0.95, decay=0.0, grad_scale=1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad has shape"):
        apply(var=w.handle, m=m.handle, v=v.handle, grad=tf.zeros((2, 3)), **scalars)
    with pytest.raises(tf.errors.InvalidArgumentError, match="three different variables"):
        apply(var=w.handle, m=w.handle, v=v.handle, grad=tf.zeros((3, 2)), **scalars)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be a scalar"):
        apply(var=w.handle, m=m.handle, v=v.handle, grad=tf.zeros((3, 2)),
              **{**scalars, "lr": [1e-3, 1e-3]})
    # A value read before the update keeps what it read (the variable is
    # copied, not written under the reader).
    w.assign(tf.ones((3, 2)))
    before = w.read_value()
    apply(var=w.handle, m=m.handle, v=v.handle, grad=tf.ones((3, 2)), **scalars)
    np.testing.assert_array_equal(before.numpy(), np.ones((3, 2)))
    assert not np.array_equal(w.numpy(), np.ones((3, 2)))
