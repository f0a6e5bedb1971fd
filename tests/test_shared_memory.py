"""The shared-memory gradient average (`tfgpt.parallel.shared_memory`):
against NumPy's mean on real ranks, bit for bit against Horovod's with two,
a peer that dies, and where it is and is not taken."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.launch import REPO, horovodrun, run
from tfgpt import kernels
from tfgpt.config.distribution import HorovodOptions
from tfgpt.parallel import shared_memory
from tfgpt.parallel.horovod_bridge import default_cycle_time

SCRIPT = REPO / "tests" / "hvd_scripts" / "shared_memory_check.py"

needs_library = pytest.mark.skipif(kernels.library() is None,
                                   reason=f"kernels: {kernels.unavailable_reason()}")


@needs_library
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, 3])
def test_average_is_numpys_mean_and_the_same_bits_on_every_rank(tmp_path, ranks):
    code, output = horovodrun(ranks, SCRIPT, tmp_path, "average")
    assert code == 0, output
    saved = [np.load(tmp_path / f"rank-{rank}.npz") for rank in range(ranks)]
    outputs = [key for key in saved[0] if key.startswith("out_")]
    assert len(outputs) == 30 * 5 + 6
    for key in outputs:
        inputs = [rank["in_" + key[4:]] for rank in saved]
        np.testing.assert_allclose(saved[0][key], np.mean(inputs, axis=0), rtol=1e-6, atol=1e-7)
        for rank in saved[1:]:
            np.testing.assert_array_equal(rank[key], saved[0][key])
    # The segment's file is gone once every rank has mapped it.
    assert not any(bool(rank["segment_left"]) for rank in saved)
    if ranks == 2:
        for rank in saved:
            assert str(rank["horovod_averaged"]) == "Horovod allreduce"
            assert str(rank["shared_averaged"]).startswith("shared memory")
            trained = [key for key in rank if key.startswith("horovod_")
                       and key != "horovod_averaged"]
            assert trained
            for key in trained:  # (a + b) * 0.5 both ways
                np.testing.assert_array_equal(rank["shared_" + key[8:]], rank[key])


@needs_library
@pytest.mark.distributed
def test_a_peer_that_exits_ends_the_wait_with_an_error_naming_it(tmp_path):
    code, output = horovodrun(2, SCRIPT, tmp_path, "peer-exits", timeout=180)
    assert code == 0, output
    line = next((line for line in output.splitlines() if "rank 0 aborted after" in line), None)
    assert line is not None, output
    assert "rank 1 (pid" in line and "exited" in line
    waited = float(line.split("after ")[1].split(" s")[0])
    assert waited < 30, line  # not the 120 s timeout


@needs_library
def test_one_rank_segment_returns_its_input_and_mapping_errors_name_the_cause(tmp_path):
    library = kernels.library()
    path = str(tmp_path / "segment")
    library.tfgpt_shm_attach(path=path, key=12345, rank=0, size=1, capacity=100)
    values = [tf.constant([1.5, -2.0, 3.25]), tf.constant([[7.0]])]
    for value, result in zip(values, library.tfgpt_shm_allreduce(values, key=12345)):
        np.testing.assert_array_equal(result, value)
    with pytest.raises(tf.errors.InvalidArgumentError, match="do not fit"):
        library.tfgpt_shm_allreduce([tf.zeros([200])], key=12345)
    with pytest.raises(tf.errors.FailedPreconditionError, match="not attached"):
        library.tfgpt_shm_allreduce([tf.zeros([2])], key=54321)
    with pytest.raises(tf.errors.UnavailableError, match="cannot open"):
        library.tfgpt_shm_attach(path=str(tmp_path / "no" / "such"), key=1, rank=0, size=1,
                                 capacity=1)
    # More than the file system holds: refused when mapped, not a SIGBUS later.
    huge = str(tmp_path / "huge")
    try:
        with pytest.raises(tf.errors.ResourceExhaustedError, match="cannot reserve"):
            library.tfgpt_shm_attach(path=huge, key=2, rank=0, size=1, capacity=2**50)
    finally:
        if os.path.exists(huge):
            os.unlink(huge)


@pytest.mark.parametrize("overrides, workers, local, gpus, reason", [
    ({}, 1, 1, False, "one worker"),
    ({}, 4, 2, False, "more than one host"),
    ({}, 2, 2, True, "GPUs"),
    ({"zero_stage": 1}, 2, 2, False, "--zero-stage 1"),
    ({"tensor_parallel": 2}, 2, 2, False, "--tensor-parallel 2"),
    ({"pipeline_parallel": 2}, 2, 2, False, "--pipeline-parallel 2"),
    ({"elastic": True}, 2, 2, False, "--elastic"),
    ({"fp16_allreduce": True}, 2, 2, False, "--fp16-allreduce"),
])
def test_where_shared_memory_does_not_apply_the_reason_is_named(overrides, workers, local, gpus,
                                                                reason):
    options = HorovodOptions(**overrides)
    assert reason in shared_memory.unavailable_reason(options, workers, local, gpus)


@needs_library
def test_two_workers_on_one_host_take_it():
    assert shared_memory.unavailable_reason(HorovodOptions(), 2, 2, False) == ""


def test_an_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="allreduce_transport"):
        HorovodOptions(allreduce_transport="nccl")


def test_shared_memory_where_it_cannot_work_is_one_error_line(tiny_data, tmp_path):
    code, output = run([sys.executable, REPO / "train_hvd.py", "--data", tiny_data,
                        "--out", tmp_path / "run", "--preset", "gpt-demo", "--num-layers", "1",
                        "--hidden-dim", "16", "--num-heads", "2", "--intermediate-dim", "32",
                        "--max-sequence-length", "16", "--steps", "2",
                        "--allreduce-transport", "shared-memory"])
    assert code != 0
    errors = [line for line in output.splitlines() if "--allreduce-transport" in line]
    assert errors and "one worker" in errors[-1], output
    assert "Traceback" not in output and "model:" not in output


@needs_library
@pytest.mark.parametrize("overrides, environ, cycle", [
    ({}, {"HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2"}, "50"),
    ({"allreduce_transport": "horovod"}, {"HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2"}, "10"),
    ({}, {"HOROVOD_SIZE": "4", "HOROVOD_LOCAL_SIZE": "2"}, "10"),
    ({}, {}, "10"),
    ({"pipeline_parallel": 2}, {"HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2"}, "1"),
])
def test_horovod_cycles_slowly_when_shared_memory_will_average(overrides, environ, cycle):
    # Horovod then carries only a few collectives per logging window.
    assert default_cycle_time(HorovodOptions(**overrides), environ) == cycle
