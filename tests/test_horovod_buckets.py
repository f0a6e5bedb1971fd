"""How `HorovodDistribution` cuts gradients into allreduce buckets (no Horovod
needed: the averaging itself is checked on two real ranks in
test_distributed.py)."""

import pytest
import tensorflow as tf

from tfgpt.parallel.horovod_bridge import HorovodDistribution, gradient_buckets


def _gradients(*sizes, dtype="float32"):
    return [tf.zeros([size], dtype) for size in sizes]


def test_buckets_close_once_full_from_the_last_gradient_back():
    # float32: 4 bytes per element; buckets of at least 40 bytes.
    gradients = _gradients(3, 4, 6, 2, 1, 8, 5)
    buckets = gradient_buckets(gradients, 40)
    # 5 + 8 elements = 52 bytes; 1 + 2 + 6 = 36 bytes is short, + 4 = 52.
    assert buckets == [[6, 5], [4, 3, 2, 1], [0]]
    # Each gradient exactly once, backward order kept.
    assert [index for bucket in buckets for index in bucket] == list(range(6, -1, -1))
    # Every bucket but the first-computed-last one holds at least 40 bytes.
    for bucket in buckets[:-1]:
        assert sum(gradients[index].shape[0] * 4 for index in bucket) >= 40


def test_zero_bytes_gives_one_bucket_per_gradient_and_dtype_sets_the_size():
    assert gradient_buckets(_gradients(3, 4, 6), 0) == [[2], [1], [0]]
    # bfloat16 halves the bytes: 10 + 10 elements fill a 40-byte bucket together.
    assert gradient_buckets(_gradients(10, 10, 10, dtype="bfloat16"), 40) == [[2, 1], [0]]
    assert gradient_buckets([], 40) == []


def test_a_gradient_of_unknown_size_closes_its_bucket():
    unknown = tf.TensorSpec([None], "float32")
    assert gradient_buckets([*_gradients(1, 1), unknown, *_gradients(1)], 1000) == [
        [3, 2], [1, 0]]


@pytest.mark.parametrize("bucket_mb", [-1, float("nan"), "3", True])
def test_bad_bucket_size_is_refused_before_horovod_starts(bucket_mb):
    with pytest.raises(ValueError, match="bucket_mb"):
        HorovodDistribution(bucket_mb=bucket_mb)
