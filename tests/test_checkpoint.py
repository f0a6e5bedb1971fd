"""The checkpoint format (`tfgpt.checkpoint`) in one process: regions written by
several ranks, read back as other layouts hold them, and what it refuses.

The ranks here are simulated: each "rank" writes its entries with
`files.write_rank`, as `RunCheckpointer.save` does between its barriers, and
the chief commits. The oracle is NumPy: the region a layout holds is
`take_slice` of the whole array, then rows of it.
"""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tfgpt.checkpoint import RunCheckpointer, files
from tfgpt.checkpoint.state import Entry
from tfgpt.parallel import LocalDistribution
from tfgpt.parallel.tensor_parallel import take_slice

# A fused query/key/value-like kernel (C=4, 3 groups of 2 heads x 2), cut
# in 2 tensor slices along its columns; a bias cut into rows only; a counter.
KERNEL = np.arange(4 * 12, dtype=np.float32).reshape(4, 12)
BIAS = np.arange(5, dtype=np.float32) / 7
RULE = (1, 3)


def _write(directory, step, writers, meta=None, keep=0):
    """Each writer is `(rank, [Entry])`; writes them and commits."""
    for rank, entries in writers:
        files.write_rank(str(directory), step, rank, [e.variable.numpy() for e in entries],
                         [e.record(rank, (rank, 0, 0)) for e in entries])
    files.commit(str(directory), step, len(writers), {"layout": meta or {}}, keep)


def _sharded_writers():
    """4 ranks: 2 tensor slices x 2 ZeRO shards of each slice's rows; rank 0
    writes the bias rows 0-3 and rank 1 rows 3-5; rank 0 the counter."""
    writers = []
    for rank in range(4):
        tensor_index, shard = divmod(rank, 2)
        part = take_slice(KERNEL, RULE, 2, tensor_index)  # (4, 6)
        rows = (0, 3) if shard == 0 else (3, 4)
        entries = [Entry("kernel", tf.Variable(part[rows[0]:rows[1]]), KERNEL.shape, RULE,
                         (2, tensor_index), (*rows, 4))]
        if rank < 2:
            bias_rows = (0, 3) if rank == 0 else (3, 5)
            entries.append(Entry("bias", tf.Variable(BIAS[bias_rows[0]:bias_rows[1]]), (5,),
                                 rows=(*bias_rows, 5)))
        if rank == 0:
            entries.append(Entry("step", tf.Variable(7, dtype=tf.int64), ()))
        writers.append((rank, entries))
    return writers


def test_regions_of_four_ranks_are_read_as_any_layout_holds_them(tmp_path):
    _write(tmp_path, 7, _sharded_writers())
    reader = files.Reader(files.latest(str(tmp_path)))
    np.testing.assert_array_equal(reader.whole("kernel"), KERNEL)
    np.testing.assert_array_equal(reader.whole("bias"), BIAS)
    assert reader.part("step") == 7
    # One process; 3 tensor slices (another T); 2 slices and 3 rows of one.
    np.testing.assert_array_equal(reader.part("kernel", KERNEL.shape), KERNEL)
    for index in range(3):
        np.testing.assert_array_equal(reader.part("kernel", KERNEL.shape, RULE, (3, index)),
                                      take_slice(KERNEL, RULE, 3, index))
    np.testing.assert_array_equal(reader.part("kernel", KERNEL.shape, RULE, (2, 1), (1, 4)),
                                  take_slice(KERNEL, RULE, 2, 1)[1:4])
    np.testing.assert_array_equal(reader.part("bias", (5,), rows=(2, 5)), BIAS[2:5])
    reader.close()


def test_a_run_checkpointer_restores_its_variables_and_keeps_the_newest(tmp_path):
    weights = tf.Variable(np.ones((3, 2), np.float32))
    step = tf.Variable(0, dtype=tf.int64)
    checkpointer = RunCheckpointer(str(tmp_path), LocalDistribution(), lambda: [
        Entry("weights", weights, (3, 2)), Entry("step", step, ())], keep=2)
    for at in (2, 4, 6):
        weights.assign(weights * 2)
        step.assign(at)
        assert checkpointer.save(at) == str(tmp_path / f"ckpt-{at}")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-4", "ckpt-6"]
    weights.assign(tf.zeros((3, 2)))
    assert checkpointer.restore_latest() == str(tmp_path / "ckpt-6")
    np.testing.assert_array_equal(weights.numpy(), np.full((3, 2), 8.0))
    assert int(step.numpy()) == 6


def test_an_interrupted_save_leaves_the_previous_checkpoint_the_latest(tmp_path):
    _write(tmp_path, 2, _sharded_writers())
    # Step 4's ranks wrote their files; the chief died before the index.
    for rank, entries in _sharded_writers():
        files.write_rank(str(tmp_path), 4, rank, [e.variable.numpy() for e in entries],
                         [e.record(rank, (rank, 0, 0)) for e in entries])
    assert files.latest(str(tmp_path)) == str(tmp_path / "ckpt-2")
    with pytest.raises(ValueError, match=r"ckpt-4 has no index.json: its save did not finish"):
        files.Reader(str(tmp_path / "ckpt-4"))
    # The next save of a later step removes it.
    _write(tmp_path, 6, _sharded_writers())
    assert sorted(os.listdir(tmp_path)) == ["ckpt-2", "ckpt-6"]


def test_missing_files_other_saves_and_other_models_are_one_line_each(tmp_path):
    _write(tmp_path / "a", 2, _sharded_writers())
    _write(tmp_path / "b", 2, _sharded_writers())
    path = tmp_path / "a" / "ckpt-2"
    reader = files.Reader(str(path))
    with pytest.raises(ValueError, match=r"ckpt-2 holds no 'embeddings': it is another model's"):
        reader.part("embeddings", (3,))
    with pytest.raises(ValueError, match=r"ckpt-2 holds 'kernel' with shape \(4, 12\); this "
                                         r"model's is \(4, 16\): another model's checkpoint"):
        reader.part("kernel", (4, 16))
    # A file of the other run's save: the same shapes, another stamp.
    shutil.copy(tmp_path / "b" / "ckpt-2" / "rank-00003.npz", path / "rank-00003.npz")
    with pytest.raises(ValueError, match=r"rank-00003.npz does not belong to this checkpoint: "
                                         r"another save wrote it"):
        files.Reader(str(path)).whole("kernel")
    (path / "rank-00003.npz").unlink()
    with pytest.raises(ValueError, match=r"ckpt-2 is incomplete: its index names 1 chunk "
                                         r"file\(s\) that are missing: rank-00003.npz"):
        files.Reader(str(path))
    # Rows that no chunk covers (an index edited by hand, or a writer lost).
    index = json.loads((tmp_path / "b" / "ckpt-2" / "index.json").read_text())
    index["keys"]["bias"]["chunks"] = index["keys"]["bias"]["chunks"][:1]
    (tmp_path / "b" / "ckpt-2" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks rows 3-5 of 'bias'"):
        files.Reader(str(tmp_path / "b" / "ckpt-2")).whole("bias")


def test_tensorflow_checkpoints_of_earlier_versions_are_refused_naming_them(tmp_path):
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-3"\n')
    (tmp_path / "ckpt-3.index").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds TensorFlow checkpoint files \(ckpt-N.index\) of "
                                         r"an earlier tfgpt, not chunked checkpoints"):
        files.latest(str(tmp_path))


def test_bfloat16_values_round_trip(tmp_path):
    value = tf.Variable(tf.constant([1.5, -2.25, 3.0], tf.bfloat16))
    _write(tmp_path, 1, [(0, [Entry("half", value, (3,))])])
    read = files.Reader(str(tmp_path / "ckpt-1")).part("half", (3,))
    assert read.dtype == tf.bfloat16.as_numpy_dtype
    np.testing.assert_array_equal(read.astype(np.float32), [1.5, -2.25, 3.0])
