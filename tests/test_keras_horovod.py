"""`model.fit` on one device and under horovodrun (tfgpt.parallel.keras_horovod).

Single-process tests stand a recording fake in for Horovod to check what
the optimizer wrapper and the callbacks send and receive; the multi-process
tests run real `horovodrun -np 2` jobs with different data on each rank.
"""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipelines import reader
from tests.launch import REPO, horovodrun
from tfgpt import GPT
from tfgpt.optim.schedules import WarmupDecay
from tfgpt.parallel import keras_horovod
from tfgpt.parallel.keras_horovod import (
    AverageMetrics,
    BroadcastInitialState,
    DistributedOptimizer,
)
from tfgpt.parallel.state import ParallelState

VOCABULARY = 29
BATCH, SEQUENCE = 3, 6


class FakeDistribution:
    """Stands in for HorovodDistribution in one process and records every call.

    `allreduce_gradients` scales by `gradient_factor` (0.5 is the mean with a
    second rank whose gradients are zero); `allreduce_mean` adds `offset`.
    """

    def __init__(self, rank=0, size=2, gradient_factor=0.5, offset=0.0):
        self.rank, self.size, self.is_chief = rank, size, rank == 0
        self.state = ParallelState(size, rank=rank)  # every distribution's (data parallel)
        self.gradient_factor, self.offset = gradient_factor, offset
        self.gradient_calls, self.mean_calls, self.broadcasts = [], [], []

    def allreduce_gradients(self, gradients):
        self.gradient_calls.append(list(gradients))
        return [gradient * self.gradient_factor for gradient in gradients]

    def allreduce_mean(self, value):
        self.mean_calls.append(value)
        return value + self.offset

    def broadcast_variables(self, variables):
        self.broadcasts.append(list(variables))


@pytest.fixture
def float32_policy():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


def tiny_gpt(seed=0):
    keras.utils.set_random_seed(seed)
    return GPT(vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=8,
               intermediate_dim=12, max_sequence_length=8)


def batches(count, seed=0):
    rng = np.random.default_rng(seed)
    shape = (count * BATCH, SEQUENCE)
    return (rng.integers(0, VOCABULARY, shape).astype("int32"),
            rng.integers(0, VOCABULARY, shape).astype("int32"))


def loss_function():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def distributed(optimizer, fake=None):
    return DistributedOptimizer(optimizer, fake or FakeDistribution())


def compiled(model, optimizer, **kwargs):
    model.compile(optimizer=optimizer, loss=loss_function(), **{"jit_compile": False, **kwargs})
    return model


# --- DistributedOptimizer -------------------------------------------------


def test_fit_applies_the_averaged_dense_gradients(float32_policy):
    model = tiny_gpt()
    fake = FakeDistribution(gradient_factor=0.5)
    compiled(model, DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1), fake))
    inputs, targets = batches(1)
    initial = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = loss_function()(targets, model(inputs, training=True))
    local = [tf.convert_to_tensor(g).numpy()
             for g in tape.gradient(loss, [v.value for v in model.trainable_variables])]

    model.fit(inputs, targets, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    # One traced call with every gradient, dense (the embedding's are IndexedSlices).
    (sent,) = fake.gradient_calls
    assert len(sent) == len(model.trainable_variables)
    assert all(isinstance(g, tf.Tensor) for g in sent)
    for before, gradient, variable in zip(initial, local, model.trainable_variables):
        np.testing.assert_allclose(before - variable.numpy(), 0.1 * 0.5 * gradient, atol=1e-7)


def test_optimizer_delegates_rate_step_and_state_to_the_inner_optimizer(float32_policy):
    model = tiny_gpt()
    schedule = WarmupDecay(1.0, warmup_steps=4, total_steps=10)
    inner = keras.optimizers.Adam(learning_rate=schedule)
    optimizer = DistributedOptimizer(inner, FakeDistribution())
    optimizer.build(model.trainable_variables)
    assert optimizer.iterations is inner.iterations
    inner.iterations.assign(2)
    assert float(optimizer.learning_rate) == pytest.approx(float(schedule(2)))
    # Adam's two slots per weight are part of what BroadcastInitialState sends.
    assert set(map(id, inner.variables)) <= set(map(id, optimizer.variables))
    assert len(inner.variables) >= 2 * len(model.trainable_variables)

    constant = DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1), FakeDistribution())
    constant.learning_rate = 0.25
    assert float(constant.inner_optimizer.learning_rate) == 0.25


def test_optimizer_config_round_trips_without_a_distribution():
    optimizer = DistributedOptimizer(keras.optimizers.AdamW(learning_rate=3e-4, weight_decay=0.05),
                                     name="distributed")
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored, DistributedOptimizer)
    assert restored.name == "distributed"
    assert restored.inner_optimizer.get_config() == optimizer.inner_optimizer.get_config()
    assert restored._distribution is None  # Horovod is started on first use only


def test_saved_model_restores_the_optimizer_state_without_starting_horovod(
    tmp_path, float32_policy
):
    # What ModelCheckpoint(save_weights_only=False) writes on rank 0.
    model = compiled(tiny_gpt(), distributed(keras.optimizers.Adam(0.01)))
    inputs, targets = batches(2)
    model.fit(inputs, targets, batch_size=BATCH, shuffle=False, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert isinstance(loaded.optimizer, DistributedOptimizer)
    assert loaded.optimizer._distribution is None
    assert int(loaded.optimizer.iterations) == 2
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())


def test_optimizer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="keras.optimizers.Optimizer. Received: optimizer='sgd'"):
        DistributedOptimizer("sgd")
    once = DistributedOptimizer(keras.optimizers.SGD(), FakeDistribution())
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        DistributedOptimizer(once)
    with pytest.raises(ValueError, match=r"on the inner optimizer. Received: \['clipnorm'\]"):
        DistributedOptimizer(keras.optimizers.SGD(), clipnorm=1.0)


# --- XLA, float16 and a plain optimizer are refused before the first step ---


def test_jit_compiled_fit_is_refused_before_the_first_step(float32_policy):
    model = compiled(tiny_gpt(), distributed(keras.optimizers.SGD(0.1)), jit_compile=True)
    initial = [v.numpy() for v in model.trainable_variables]
    inputs, targets = batches(1)
    with pytest.raises(ValueError, match=r"jit_compile=False.*Received: model.jit_compile=True"):
        model.fit(inputs, targets, batch_size=BATCH, verbose=0,
                  callbacks=[BroadcastInitialState(FakeDistribution())])
    for before, variable in zip(initial, model.trainable_variables):
        np.testing.assert_array_equal(before, variable.numpy())


def test_allreduce_inside_an_xla_cluster_is_refused_while_tracing(float32_policy):
    # Without the callback (a custom loop, or it was left out): the optimizer
    # refuses while the jit-compiled step is traced, instead of TensorFlow's
    # "No registered 'HorovodAllreduce' OpKernel for XLA_CPU_JIT" at run time.
    fake = FakeDistribution()
    model = compiled(tiny_gpt(), DistributedOptimizer(keras.optimizers.SGD(0.1), fake),
                     jit_compile=True)
    inputs, targets = batches(1)
    with pytest.raises(ValueError, match="cannot run inside an XLA cluster"):
        model.fit(inputs, targets, batch_size=BATCH, verbose=0)
    assert fake.gradient_calls == []


def test_mixed_float16_loss_scaling_around_the_distributed_optimizer_is_refused(float32_policy):
    keras.config.set_dtype_policy("mixed_float16")
    model = compiled(tiny_gpt(), distributed(keras.optimizers.SGD(0.1)))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    inputs, targets = batches(1)
    with pytest.raises(ValueError, match="mixed_bfloat16.*Received: dtype_policy='mixed_float16'"):
        model.fit(inputs, targets, batch_size=BATCH, verbose=0,
                  callbacks=[BroadcastInitialState(FakeDistribution())])


def test_a_plain_optimizer_is_refused_because_it_would_not_average(float32_policy):
    model = compiled(tiny_gpt(), keras.optimizers.SGD(0.1))
    inputs, targets = batches(1)
    with pytest.raises(ValueError, match="must be a tfgpt.parallel.keras_horovod.Distributed"):
        model.fit(inputs, targets, batch_size=BATCH, verbose=0,
                  callbacks=[BroadcastInitialState(FakeDistribution())])


# --- Callbacks --------------------------------------------------------------


def test_broadcast_sends_model_and_built_optimizer_state_before_the_first_step(float32_policy):
    fake = FakeDistribution()
    optimizer = DistributedOptimizer(keras.optimizers.Adam(0.01), fake)
    model = compiled(tiny_gpt(), optimizer)
    seen_at_first_batch = []

    class FirstBatch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                seen_at_first_batch.append((len(fake.broadcasts), int(optimizer.iterations)))

    inputs, targets = batches(2)
    model.fit(inputs, targets, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[BroadcastInitialState(fake), FirstBatch()])
    assert seen_at_first_batch == [(1, 0)]
    (sent,) = fake.broadcasts
    sent_ids = set(map(id, sent))
    assert set(map(id, model.variables)) <= sent_ids
    assert set(map(id, optimizer.inner_optimizer.variables)) <= sent_ids  # moments included
    assert len(sent) == len(sent_ids)


def test_average_logs_packs_numeric_values_into_one_collective():
    fake = FakeDistribution(offset=1.0)
    logs = {"loss": 2.0, "val_loss": np.float32(3.0), "accuracy": tf.constant(0.5),
            "steps": 7, "note": "text"}
    averaged = keras_horovod.average_logs(logs, fake)
    assert averaged == {"loss": 3.0, "val_loss": 4.0, "accuracy": 1.5, "steps": 8.0, "note": "text"}
    assert len(fake.mean_calls) == 1  # one allreduce for all metrics
    assert logs["loss"] == 2.0  # the input is left alone
    assert keras_horovod.average_logs({}, fake) == {}


def test_average_metrics_rewrites_epoch_logs_for_the_callbacks_after_it(float32_policy):
    fake = FakeDistribution(offset=10.0)  # "the other rank" shifts every metric
    local, after = [], []

    class Snapshot(keras.callbacks.Callback):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def on_epoch_end(self, epoch, logs=None):
            self.into.append(dict(logs))

    model = compiled(tiny_gpt(), DistributedOptimizer(keras.optimizers.SGD(0.1), fake))
    inputs, targets = batches(2)
    history = model.fit(inputs, targets, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=batches(1, seed=1),
                        callbacks=[Snapshot(local), AverageMetrics(fake), Snapshot(after)])
    for before, later in zip(local, after):
        assert set(before) == {"loss", "val_loss"}
        for key in before:
            assert later[key] == pytest.approx(before[key] + 10.0)
    # History comes after the user's callbacks, so fit returns the global values.
    assert history.history["loss"] == pytest.approx([epoch["loss"] for epoch in after])


def test_rank_zero_only_keeps_writers_on_rank_zero():
    writers = [keras.callbacks.CSVLogger("log.csv"), keras.callbacks.History()]
    assert keras_horovod.rank_zero_only(writers, FakeDistribution(rank=0)) == writers
    assert keras_horovod.rank_zero_only(writers, FakeDistribution(rank=1)) == []
    with pytest.raises(ValueError, match="Received an element 'tensorboard'"):
        keras_horovod.rank_zero_only(["tensorboard"], FakeDistribution())


# --- model.fit on one device, on the real reader ------------------------------


def fit_on_reader(data, callbacks=(), epochs=3, steps_per_epoch=20):
    vocabulary_size = reader.load_manifest(data)["tokenizer"]["vocabulary_size"]
    keras.utils.set_random_seed(0)
    model = GPT(vocabulary_size=vocabulary_size, num_layers=2, num_heads=2, hidden_dim=32,
                intermediate_dim=48, max_sequence_length=16)
    schedule = WarmupDecay(3e-3, warmup_steps=5, total_steps=epochs * steps_per_epoch)
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01),
                  loss=loss_function())
    # Both datasets repeat; validation_steps is one full pass over the split.
    history = model.fit(
        reader.make_dataset(data, "train", 8, seed=0),
        epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False,  # the reader shuffles
        validation_data=reader.make_dataset(data, "val", 8, shuffle=False),
        validation_steps=reader.steps_per_epoch(data, "val", 8),
        callbacks=list(callbacks), verbose=0,
    )
    return model, schedule, history.history


def epoch_scalars(directory, tag):
    values = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = float(tf.make_ndarray(value.tensor))
    return [values[step] for step in sorted(values)]


@pytest.mark.slow
def test_gpt_fits_the_reader_with_tensorboard_checkpoints_and_the_schedule(
    tiny_data, tmp_path, float32_policy
):
    callbacks = [
        keras.callbacks.TensorBoard(str(tmp_path / "tensorboard")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}.weights.h5"),
                                        save_weights_only=True),
    ]
    model, schedule, history = fit_on_reader(tiny_data, callbacks)

    assert history["loss"][-1] < 0.75 * history["loss"][0], history
    assert history["val_loss"][-1] < history["val_loss"][0], history
    # The schedule drives the optimizer: TensorBoard logged its value at
    # the end of every epoch of 20 steps.
    np.testing.assert_allclose(
        epoch_scalars(tmp_path / "tensorboard" / "train", "epoch_learning_rate"),
        [float(schedule(20 * epoch)) for epoch in (1, 2, 3)], rtol=1e-6)
    assert epoch_scalars(tmp_path / "tensorboard" / "validation", "epoch_loss") == pytest.approx(
        history["val_loss"])
    # The last checkpoint holds the trained weights.
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [
        "ckpt-1.weights.h5", "ckpt-2.weights.h5", "ckpt-3.weights.h5"]
    restored = GPT(**{key: value for key, value in model.get_config().items()
                      if key not in ("name", "trainable", "dtype")})
    restored.load_weights(str(tmp_path / "ckpt-3.weights.h5"))
    inputs, _ = next(iter(reader.make_dataset(tiny_data, "val", 2, shuffle=False)))
    np.testing.assert_array_equal(restored(inputs).numpy(), model(inputs).numpy())


@pytest.mark.slow
def test_gpt_fits_the_reader_under_mixed_bfloat16(tiny_data, float32_policy):
    keras.config.set_dtype_policy("mixed_bfloat16")
    model, _, history = fit_on_reader(tiny_data, epochs=2, steps_per_epoch=20)
    assert model.compute_dtype == "bfloat16"
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    assert np.isfinite(history["loss"]).all() and np.isfinite(history["val_loss"]).all()
    assert history["loss"][-1] < 0.85 * history["loss"][0], history


# --- Real processes --------------------------------------------------------


def load_ranks(directory):
    return [np.load(directory / f"rank-{rank}.npz") for rank in (0, 1)]


@pytest.mark.distributed
def test_fit_under_horovodrun_averages_gradients_and_ends_identical(tmp_path):
    script = REPO / "tests" / "hvd_scripts" / "fit_check.py"
    code, output = horovodrun(2, script, tmp_path, "bridge")
    assert code == 0, output
    ranks = load_ranks(tmp_path)
    count = len([key for key in ranks[0] if key.startswith("final_")])
    assert count == 2 + 2 * 12 + 2  # embeddings, 2 blocks, final norm
    learning_rate = float(ranks[0]["first_learning_rate"])
    assert learning_rate == pytest.approx(0.5 * 2 / 4)  # WarmupDecay, scaled by size
    largest_difference = 0.0
    for index in range(count):
        first, second = (rank[f"local_{index}"] for rank in ranks)
        largest_difference = max(largest_difference, np.abs(first - second).max())
        # Different seeds, yet the broadcast made the start equal ...
        np.testing.assert_array_equal(ranks[0][f"initial_{index}"], ranks[1][f"initial_{index}"])
        # ... the first SGD step applied the NumPy mean of the ranks' gradients ...
        for rank in ranks:
            update = (rank[f"initial_{index}"] - rank[f"after_first_{index}"]) / learning_rate
            np.testing.assert_allclose(update, (first + second) / 2, atol=2e-6)
        # ... and the ranks ended identical after 8 steps on different data.
        np.testing.assert_array_equal(ranks[0][f"final_{index}"], ranks[1][f"final_{index}"])
        assert not np.array_equal(ranks[0][f"final_{index}"], ranks[0][f"initial_{index}"])
    assert largest_difference > 1e-2  # the ranks' own gradients differed
    assert int(ranks[0]["iterations"]) == 8

    # AverageMetrics: every rank reports the mean of the ranks' own values.
    for key in ("loss", "val_loss"):
        local = [rank[f"local_{key}"] for rank in ranks]
        assert not np.allclose(local[0], local[1])
        for rank in ranks:
            np.testing.assert_allclose(rank[f"averaged_{key}"], (local[0] + local[1]) / 2,
                                       rtol=1e-6)
    np.testing.assert_array_equal(ranks[0]["history_loss"], ranks[1]["history_loss"])

    # Only rank 0 wrote checkpoints and TensorBoard.
    assert (tmp_path / "rank-0" / "ckpt-2.weights.h5").exists()
    assert list((tmp_path / "rank-0" / "tensorboard" / "train").iterdir())
    assert not (tmp_path / "rank-1").exists()


@pytest.mark.distributed
def test_horovods_own_keras_optimizer_runs_without_averaging_and_its_callbacks_fail(tmp_path):
    """Documents why keras_horovod exists (Horovod 0.28.1, Keras 3.15).

    If this fails because Horovod's Keras integration started to work (or
    stopped importing), update the module docstring of keras_horovod.
    """
    script = REPO / "tests" / "hvd_scripts" / "fit_check.py"
    code, output = horovodrun(2, script, tmp_path, "horovod-keras")
    assert code == 0, output
    ranks = load_ranks(tmp_path)
    if "construct_error" in ranks[0]:
        pytest.fail(f"horovod.tensorflow.keras.DistributedOptimizer can no longer be built: "
                    f"{ranks[0]['construct_error']}")
    count = len([key for key in ranks[0] if key.startswith("final_")])
    assert count > 0
    # It trained without an error, from identical weights, yet the ranks drifted apart.
    for index in range(count):
        np.testing.assert_array_equal(ranks[0][f"initial_{index}"], ranks[1][f"initial_{index}"])
    drift = max(np.abs(ranks[0][f"final_{i}"] - ranks[1][f"final_{i}"]).max() for i in range(count))
    assert drift > 1e-3
    assert "not callable" in str(ranks[0]["variables_error"])
    assert "'ref'" in str(ranks[0]["callback_broadcast"])
    assert "constant" in str(ranks[0]["callback_metric_average"])
    assert "get_value" in str(ranks[0]["callback_learning_rate_warmup"])
