"""Training core: flags, schedule, optimizer, train step (single process)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config import TrainConfig
from tfgpt.optim.lamb import LAMB
from tfgpt.optim.optimizers import learning_rate_schedule, make_optimizer
from tfgpt.optim.schedules import WarmupDecay
from tfgpt.parallel import LocalDistribution
from tfgpt.training.flags import parse_flags
from tfgpt.training.train_step import TrainStep, cross_entropy

# ---- Flags --------------------------------------------------------------


def test_flags_apply_preset_then_overrides():
    train_config, overrides = parse_flags(
        ["--data", "d", "--preset", "gpt-mini", "--batch-size", "3", "--num-layers", "2",
         "--no-tie-embeddings", "--xla"]
    )
    assert train_config.batch_size == 3 and train_config.xla is True
    assert train_config.preset == "gpt-mini"
    assert overrides == {"num_layers": 2, "tie_embeddings": False}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "d", "--batch-sise", "3"], "unrecognized arguments: --batch-sise"),
        (["--data", "d", "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["--data", "d", "--preset", "gpt5"], "preset='gpt5'"),
        (["--data", "d", "--hidden-dim", "10", "--num-heads", "4"], "hidden_dim=10, num_heads=4"),
        (["--data", "d", "--mixed-precision", "fp8"],
         "argument --mixed-precision: invalid choice: 'fp8'"),
        (["--data", "d", "--batch-size", "0"], "batch_size=0"),
        # Horovod's options are the Horovod front ends' (tests/test_flags.py).
        (["--data", "d", "--allreduce-bucket-mb", "1"],
         "--allreduce-bucket-mb is a flag of train_hvd.py and finetune_hvd.py"),
        ([], "`data` is required"),
    ],
)
def test_bad_flags_exit_with_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_flags(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


# ---- Schedule and optimizer ---------------------------------------------


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_schedule_matches_closed_form(decay):
    peak, warmup, total, floor = 3e-3, 7, 50, 0.1
    schedule = WarmupDecay(peak, warmup, total, decay=decay, final_ratio=floor)
    for step in [0, 3, 6, 7, 20, 49, 50, 80]:
        if step < warmup:
            expected = peak * (step + 1) / warmup
        else:
            progress = min((step - warmup) / (total - warmup), 1.0)
            shape = {
                "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
                "linear": 1 - progress,
                "constant": 1.0,
            }[decay]
            expected = peak * (floor + (1 - floor) * shape)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5), step


def test_learning_rate_scales_with_workers():
    config = TrainConfig(data="d", learning_rate=1e-3, warmup_steps=0, schedule="constant")
    assert float(make_optimizer(config, num_workers=4).learning_rate) == pytest.approx(4e-3)
    config = TrainConfig(
        data="d", learning_rate=1e-3, warmup_steps=0, schedule="constant",
        scale_learning_rate=False,
    )
    assert float(make_optimizer(config, num_workers=4).learning_rate) == pytest.approx(1e-3)


def test_weight_decay_skips_norms_biases_and_embeddings():
    model = GPT(vocabulary_size=31, num_layers=2, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8)
    optimizer = make_optimizer(TrainConfig(data="d"))
    decayed = {v.path for v in model.trainable_variables if optimizer._use_weight_decay(v)}
    assert decayed == {v.path for v in model.trainable_variables if v.name == "kernel"}
    assert len(decayed) == 2 * 4


# ---- Train step ---------------------------------------------------------


def test_cross_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype("float32")
    targets = rng.integers(0, 7, (2, 5))
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    assert float(cross_entropy(targets, logits)) == pytest.approx(expected, rel=1e-5)


class HalvingDistribution(LocalDistribution):
    """Pretends a second worker sent zero gradients: the average halves them."""

    def allreduce_gradients(self, gradients):
        return [g / 2 for g in gradients]


def _weighted_loss(model, batch, training):
    inputs, targets, weights = batch
    return cross_entropy(targets, model(inputs, training=training), weights), {}


@pytest.mark.parametrize("xla", [False, True])
def test_tokens_of_weight_zero_get_exactly_zero_gradient(xla):
    """Their logits' gradient is 0.0, and whatever their targets, a step
    leaves the same weights, bit for bit (a weighted, globally normalised loss)."""
    import keras

    rng = np.random.default_rng(3)
    inputs = rng.integers(0, 23, (2, 6)).astype("int32")
    targets = rng.integers(0, 23, (2, 6)).astype("int32")
    weights = (rng.random((2, 6)) < 0.5).astype("float32")
    weights[0, 0], weights[1, 3] = 0.0, 1.0
    other = np.where(weights == 0, (targets + 7) % 23, targets).astype("int32")

    def step_with(targets):
        keras.utils.set_random_seed(4)
        model = GPT(vocabulary_size=23, num_layers=2, num_heads=2, hidden_dim=8,
                    intermediate_dim=12, max_sequence_length=8)
        optimizer = keras.optimizers.SGD(learning_rate=0.5)
        step = TrainStep(model, optimizer, LocalDistribution(), loss_fn=_weighted_loss, xla=xla,
                         token_weights=lambda batch: batch[2])
        loss = float(step((inputs, targets, weights))["loss"])
        return model, loss, [v.numpy() for v in model.trainable_variables]

    model, loss, after = step_with(targets)
    _, other_loss, other_after = step_with(other)
    assert loss == other_loss
    for mine, theirs in zip(after, other_after):
        np.testing.assert_array_equal(mine, theirs)
    logits = tf.Variable(model(inputs))
    with tf.GradientTape() as tape:
        loss = cross_entropy(targets, logits, weights)
    gradient = tape.gradient(loss, logits).numpy()
    assert np.all(gradient[weights == 0] == 0.0)
    assert np.all(np.abs(gradient[weights == 1]).max(axis=-1) > 0)


@pytest.mark.parametrize("xla", [False, True])
def test_train_step_applies_the_averaged_gradients(xla):
    """One SGD-like step with the step's own gradients equals a manual update,
    and the distribution's averaging is applied to what the optimizer sees."""
    import keras

    def build():
        keras.utils.set_random_seed(3)
        return GPT(vocabulary_size=23, num_layers=2, num_heads=2, hidden_dim=8,
                   intermediate_dim=12, max_sequence_length=8)

    rng = np.random.default_rng(1)
    inputs = rng.integers(0, 23, (3, 5)).astype("int32")
    targets = rng.integers(0, 23, (3, 5)).astype("int32")

    model = build()
    with tf.GradientTape() as tape:
        loss = cross_entropy(targets, model(inputs, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)
    expected = [
        v.numpy() - 0.1 * tf.convert_to_tensor(g).numpy() / 2
        for v, g in zip(model.trainable_variables, gradients)
    ]

    model = build()
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    step = TrainStep(model, optimizer, HalvingDistribution(), xla=xla)
    step_loss = step(inputs, targets)["loss"]
    assert float(step_loss) == pytest.approx(float(loss), rel=1e-5)
    for variable, value in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(variable.numpy(), value, atol=1e-6, err_msg=variable.path)


# ---- LAMB ---------------------------------------------------------------


def _np_lamb(weights, gradients_per_step, lr, decay, adapt, beta_1=0.9, beta_2=0.999, epsilon=1e-6):
    w = weights.astype("float64")
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(gradients_per_step, start=1):
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g * g
        r = (m / (1 - beta_1**t)) / (np.sqrt(v / (1 - beta_2**t)) + epsilon)
        if adapt:
            r = r + decay * w
            ratio = np.linalg.norm(w) / np.linalg.norm(r)
            r = ratio * r
        w = w - lr * r
    return w


def test_lamb_matches_the_paper_algorithm():
    import keras

    from tfgpt.optim.lamb import LAMB

    rng = np.random.default_rng(5)
    kernel = keras.Variable(rng.normal(size=(4, 3)).astype("float32"), name="kernel")
    bias = keras.Variable(rng.normal(size=(3,)).astype("float32"), name="bias")
    initial = [kernel.numpy(), bias.numpy()]
    optimizer = LAMB(learning_rate=0.05, weight_decay=0.1)
    gradients = [[rng.normal(size=(4, 3)), rng.normal(size=(3,))] for _ in range(3)]
    for kernel_gradient, bias_gradient in gradients:
        optimizer.apply([tf.constant(kernel_gradient, tf.float32), tf.constant(bias_gradient, tf.float32)],
                        [kernel, bias])
    expected_kernel = _np_lamb(initial[0], [g[0] for g in gradients], 0.05, 0.1, adapt=True)
    expected_bias = _np_lamb(initial[1], [g[1] for g in gradients], 0.05, 0.1, adapt=False)
    np.testing.assert_allclose(kernel.numpy(), expected_kernel, atol=1e-5)
    np.testing.assert_allclose(bias.numpy(), expected_bias, atol=1e-5)
    # Keras' own Lamb decays outside the trust ratio and gives another result.
    other = keras.Variable(initial[0], name="kernel")
    keras_lamb = keras.optimizers.Lamb(learning_rate=0.05, weight_decay=0.1, epsilon=1e-6)
    for kernel_gradient, _ in gradients:
        keras_lamb.apply([tf.constant(kernel_gradient, tf.float32)], [other])
    assert np.abs(other.numpy() - expected_kernel).max() > 1e-4


def test_albert_lamb_recipe_schedule_shape():
    """lr 0.00176, warmup 3125 of 125000 steps, then linear decay to 0."""
    config = TrainConfig(data="d", optimizer="lamb", learning_rate=0.00176, warmup_steps=3125,
                         steps=125000, schedule="linear", final_learning_rate_ratio=0.0)
    assert isinstance(make_optimizer(config), LAMB)
    schedule = learning_rate_schedule(config)
    for step, expected in [(0, 0.00176 / 3125), (1561, 0.00176 * 1562 / 3125), (3125, 0.00176),
                           (64062, 0.00176 * (1 - (64062 - 3125) / (125000 - 3125))), (125000, 0.0)]:
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-4, abs=1e-9), step


# ---- Accumulation and mixed precision -----------------------------------


def _tiny_gpt(seed=3, **overrides):
    import keras

    keras.utils.set_random_seed(seed)
    config = dict(vocabulary_size=23, num_layers=2, num_heads=2, hidden_dim=8,
                  intermediate_dim=12, max_sequence_length=8)
    config.update(overrides)
    return GPT(**config)


def test_accumulated_micro_batches_equal_one_large_batch():
    rng = np.random.default_rng(2)
    inputs = rng.integers(0, 23, (6, 5)).astype("int32")
    targets = rng.integers(0, 23, (6, 5)).astype("int32")
    config = TrainConfig(data="d", warmup_steps=0, gradient_clip_norm=0.5)

    results = []
    for steps, batch in [(1, (inputs, targets)),
                         (3, (inputs.reshape(3, 2, 5), targets.reshape(3, 2, 5)))]:
        model = _tiny_gpt()
        optimizer = make_optimizer(config)
        optimizer.build(model.trainable_variables)
        step = TrainStep(model, optimizer, LocalDistribution(), accumulation_steps=steps)
        metrics = step(batch)
        results.append((float(metrics["loss"]), [v.numpy() for v in model.trainable_variables]))
    (loss_one, weights_one), (loss_three, weights_three) = results
    assert loss_three == pytest.approx(loss_one, rel=1e-5)
    for a, b in zip(weights_one, weights_three):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(weights_one, [
        v.numpy() for v in _tiny_gpt().trainable_variables]))


def test_float16_overflow_skips_the_update_and_halves_the_scale():
    import keras

    model = _tiny_gpt(dtype="mixed_float16")
    inner = keras.optimizers.AdamW(learning_rate=1e-2)
    optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**60)
    optimizer.build(model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    step = TrainStep(model, optimizer, LocalDistribution())
    rng = np.random.default_rng(0)
    batch = (rng.integers(0, 23, (2, 5)).astype("int32"), rng.integers(0, 23, (2, 5)).astype("int32"))
    metrics = step(batch)
    assert np.isfinite(float(metrics["loss"]))
    assert int(inner.iterations) == 0  # skipped: counted as step - inner iterations
    assert float(optimizer.dynamic_scale) == 2.0**59
    for a, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(a, v.numpy())
    # With a sane scale the next steps apply.
    optimizer.dynamic_scale.assign(2.0**10)
    step(batch)
    assert int(inner.iterations) == 1
    assert all(v.dtype == "float32" for v in model.trainable_variables)


# ---- Trainer, in process --------------------------------------------------


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    from pipelines import prepare
    from tests.synthetic import pattern_corpus

    root = tmp_path_factory.mktemp("data")
    pattern_corpus(root / "corpus.txt", documents=200)
    assert prepare.main(["--input", str(root / "corpus.txt"), "--output", str(root / "p"),
                         "--seq-len", "16", "--vocab-size", "300", "--val-fraction", "0.1"]) == 0
    return root / "p"


TINY = ["--num-layers", "2", "--num-heads", "2", "--hidden-dim", "16",
        "--intermediate-dim", "24", "--max-sequence-length", "16"]


def _train(argv):
    from tfgpt.training.trainer import train

    train_config, overrides = parse_flags(argv)
    return train(train_config, overrides, LocalDistribution())


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_trainer_runs_mixed_precision_with_xla_and_logs_its_metrics(
    small_data, tmp_path, precision, capsys
):
    import json

    import keras

    try:
        model, metrics = _train(["--data", str(small_data), "--out", str(tmp_path), "--steps", "4",
                                 "--log-every", "2", "--batch-size", "4", "--xla",
                                 "--mixed-precision", precision, "--accumulation-steps", "2",
                                 "--eval-batches", "1", "--peak-flops", "1e10", *TINY])
    finally:
        keras.config.set_dtype_policy("float32")
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert np.isfinite(metrics["val_loss"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["split"] == "train"][-1]
    for name in ("loss", "perplexity", "learning_rate", "gradient_norm", "tokens_per_second",
                 "sequences_per_second", "mfu"):
        assert np.isfinite(last[name]), name
    assert ("loss_scale" in last) == (precision == "float16")
    if precision == "float16":
        assert last["skipped_steps"] >= 0
    # 4 steps with the default 100 warmup steps: said once, at start-up.
    warnings = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("warning: --warmup-steps gives 100 warmup steps for a run of 4")]
    assert len(warnings) == 1


def test_nan_loss_stops_without_saving(small_data, tmp_path, capsys):
    from tfgpt.training.trainer import TrainingDiverged

    with pytest.raises(TrainingDiverged, match="loss is nan"):
        _train(["--data", str(small_data), "--out", str(tmp_path), "--steps", "6",
                "--log-every", "3", "--batch-size", "4", "--learning-rate", "1e30",
                "--warmup-steps", "0", "--gradient-clip-norm", "0", "--peak-flops", "1e10", *TINY])
    assert not list(tmp_path.glob("ckpt-*"))
    assert "warmup" not in capsys.readouterr().out  # no warmup, no warning


def test_resume_with_a_contradicting_architecture_flag_is_refused(small_data, tmp_path):
    common = ["--data", str(small_data), "--out", str(tmp_path), "--batch-size", "4",
              "--eval-batches", "1", "--peak-flops", "1e10"]
    _train([*common, "--steps", "2", *TINY])
    with pytest.raises(ValueError, match=r"--hidden-dim 32 contradicts the checkpoint.*hidden_dim=16"):
        _train([*common, "--steps", "4", "--resume", *TINY[:4], "--hidden-dim", "32"])
    # Without architecture flags the checkpoint's own shape is used.
    model, _ = _train([*common, "--steps", "4", "--resume"])
    assert model.hidden_dim == 16 and model.num_layers == 2


def test_batch_larger_than_a_workers_data_is_refused(small_data, tmp_path):
    with pytest.raises(ValueError, match=r"--batch-size 4000 x --accumulation-steps 1 needs 4000"):
        _train(["--data", str(small_data), "--out", str(tmp_path), "--batch-size", "4000",
                "--steps", "2", *TINY])


def test_fault_injection_is_a_loop_callback_read_from_the_environment():
    import doctest

    from tfgpt.resilience import faults

    assert doctest.testmod(faults).failed == 0
    assert faults.from_environment(LocalDistribution(), {}) == []
    [fault] = faults.from_environment(LocalDistribution(), {
        faults.SLOW_COMPUTE: "0:0.5", faults.GROW_MIB: "1:4", faults.KILL_AFTER_SAVE: "3"})
    # This process is rank 0: its delay, not rank 1's memory growth.
    assert (fault.compute_delay(), fault.grow_mib()) == (0.5, 0.0)
    fault.on_step_begin(1), fault.on_step_end(1), fault.on_save(2)  # nothing due: it lives
    with pytest.raises(ValueError, match="the grow_mib fault must read RANK:VALUE. Received: '8'"):
        faults.from_environment(LocalDistribution(), {faults.GROW_MIB: "8"})
