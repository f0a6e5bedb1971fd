"""Real multi-process runs: different data per rank, identical weights after."""

import sys

import numpy as np
import pytest

from tests.launch import REPO, horovodrun, run, slurm_tasks, train_losses

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("xla", [False, True], ids=["eager-graph", "xla"])
def test_horovod_train_step_averages_gradients_and_keeps_ranks_equal(tmp_path, xla):
    script = REPO / "tests" / "hvd_scripts" / "train_step_check.py"
    code, output = horovodrun(2, script, tmp_path, *(["--xla"] if xla else []))
    assert code == 0, output
    ranks = [np.load(tmp_path / f"rank-{rank}.npz") for rank in (0, 1)]
    # The ranks saw different data, so their own gradients differ.
    assert np.abs(ranks[0]["local_0"] - ranks[1]["local_0"]).max() > 1e-4
    count = len([key for key in ranks[0] if key.startswith("final_")])
    for index in range(count):
        first, second = (r[f"local_{index}"] for r in ranks)
        # The allreduce returns their NumPy mean on every rank ...
        for rank in ranks:
            np.testing.assert_allclose(rank[f"averaged_{index}"], (first + second) / 2, atol=1e-6)
            # One allreduce per gradient, or per bucket, sums exactly what
            # one grouped allreduce of every gradient does.
            np.testing.assert_array_equal(rank[f"graph_averaged_{index}"],
                                          rank[f"grouped_averaged_{index}"])
            np.testing.assert_array_equal(rank[f"bucketed_averaged_{index}"],
                                          rank[f"grouped_averaged_{index}"])
        # ... broadcast made the start equal and averaging kept it equal.
        np.testing.assert_array_equal(ranks[0][f"initial_{index}"], ranks[1][f"initial_{index}"])
        np.testing.assert_array_equal(ranks[0][f"final_{index}"], ranks[1][f"final_{index}"])
    assert not np.array_equal(ranks[0]["final_0"], ranks[0]["initial_0"])
    assert not np.array_equal(ranks[0]["losses"], ranks[1]["losses"])
    # A loss weighted per token, rank 0 with 11 learned tokens, rank 1 with 2:
    # the global batch's (its weighted sum over its 13), not a mean of the
    # ranks' means; one process on all 4 rows is the oracle, and so are one
    # process's 2 micro-batches (11 and 2 tokens) and 2 towers.
    whole = ranks[0]
    for index in range(count):
        for rank in ranks:
            for name in ("weighted", "accumulated", "towers"):
                np.testing.assert_allclose(rank[f"{name}_{index}"], whole[f"whole_{index}"],
                                           rtol=0, atol=1e-6, err_msg=f"{name} {index}")
    for rank in ranks:
        for name in ("weighted", "accumulated", "towers"):
            np.testing.assert_allclose(rank[f"{name}_losses"], whole["whole_losses"], rtol=0,
                                       atol=1e-6, err_msg=name)
    # The mean of the ranks' means trains otherwise: the test can tell them apart.
    assert np.abs(whole["naive_0"] - whole["whole_0"]).max() > 1e-4


_PRINT_CYCLE_TIME = (
    "import os; from tfgpt.parallel.horovod_bridge import HorovodDistribution; "
    "HorovodDistribution(); print('cycle', os.environ['HOROVOD_CYCLE_TIME'])"
)


@pytest.mark.parametrize("given, expected", [(None, "10"), ("3", "3")])
def test_horovod_cycle_time_defaults_to_10_ms_unless_set(given, expected, monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    env = {"HOROVOD_CYCLE_TIME": given} if given else {}
    code, output = run([sys.executable, "-c", _PRINT_CYCLE_TIME], env=env)
    assert code == 0, output
    assert f"cycle {expected}" in output.splitlines()


_ONE_WORKER_STEP_OPS = """
import numpy as np, keras, tensorflow as tf
from tfgpt import GPT
from tfgpt.parallel.horovod_bridge import HorovodDistribution
from tfgpt.training.train_step import TrainStep
distribution = HorovodDistribution()
model = GPT(vocabulary_size=11, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=12,
            max_sequence_length=5)
optimizer = keras.optimizers.AdamW(1e-3)
optimizer.build(model.trainable_variables)
step = TrainStep(model, optimizer, distribution)
tokens = tf.constant(np.arange(10).reshape(2, 5) % 11, tf.int32)
graph = step._step.get_concrete_function((tokens, tokens)).graph
print("size", distribution.size, "horovod ops", sorted({op.type for op in graph.get_operations()
                                                       if op.type.startswith("Horovod")}))
"""


_STEP_COLLECTIVES_BY_TOWERS = """
import numpy as np, keras, tensorflow as tf
from tfgpt import GPT
from tfgpt.parallel.horovod_bridge import HorovodDistribution
from tfgpt.training.train_step import TrainStep
distribution = HorovodDistribution(bucket_mb=0.001)
distribution.size = 2  # traced as one of two workers (not run)
model = GPT(vocabulary_size=11, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=12,
            max_sequence_length=5)
optimizer = keras.optimizers.AdamW(1e-3)
optimizer.build(model.trainable_variables)
tokens = tf.constant(np.arange(10).reshape(2, 5) % 11, tf.int32)
for towers in (1, 2, 1):
    step = TrainStep(model, optimizer, distribution, towers=towers)
    graph = step._step.get_concrete_function((tokens, tokens)).graph
    names = sorted(op.name for op in graph.get_operations() if op.type.startswith("Horovod"))
    print("towers", towers, " ".join(names))
"""


def test_a_step_names_its_collectives_alike_whatever_its_towers():
    # Horovod pairs the ranks' collectives by name: workers whose steps run
    # different towers (a worker started beside another on its host has
    # fewer threads, so one tower) must name their gradient buckets alike,
    # or each waits for the other's forever (an elastic run grown 2 -> 4
    # did). The same for a step traced again in the same process.
    code, output = run([sys.executable, "-c", _STEP_COLLECTIVES_BY_TOWERS])
    assert code == 0, output
    lines = [line.split() for line in output.splitlines() if line.startswith("towers ")]
    assert [line[1] for line in lines] == ["1", "2", "1"], output
    names = [line[2:] for line in lines]
    assert len(names[0]) > 1, output  # several buckets
    assert names[0] == names[1] == names[2], output


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["--zero-stage", "3"], ["--tensor-parallel", "2"]])
def test_ranks_whose_threads_choose_different_towers_run_the_fewest(tiny_data, tmp_path, layout):
    # Rank 0 with 2 threads chooses 2 towers, rank 1 with 1 thread one (hosts
    # of different sizes do). ZeRO-3 and tensor parallelism run collectives
    # in each tower's forward pass: without agreeing on one count the two
    # ranks waited for each other at the first step (until the watchdog's
    # --collective-timeout ended them).
    flags = [REPO / "train_hvd.py", "--data", tiny_data, "--out", tmp_path, "--steps", "3",
             "--batch-size", "4", "--log-every", "1", "--eval-batches", "1", "--num-layers", "2",
             "--num-heads", "2", "--hidden-dim", "32", "--intermediate-dim", "48",
             "--max-sequence-length", "16", "--collective-timeout", "30", *layout]
    results = slurm_tasks([[*flags, "--intra-op-threads", threads] for threads in ("2", "1")],
                          timeout=150)
    assert [code for code, _ in results] == [0, 0], results
    assert "1 tower(s) per replica" in results[0][1], results[0][1]
    assert sorted(train_losses(tmp_path)) == [1, 2, 3]


def test_one_horovod_worker_averages_nothing_through_horovod():
    # Its gradients are their own average; Horovod's background thread
    # would hold every step up to one cycle for them.
    code, output = run([sys.executable, "-c", _ONE_WORKER_STEP_OPS])
    assert code == 0, output
    assert "size 1 horovod ops []" in output.splitlines(), output
