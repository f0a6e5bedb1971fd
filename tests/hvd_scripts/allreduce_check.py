"""Worker for tests/test_horovod_build.py, started by `horovodrun -np N`.

Each rank contributes a different tensor; every rank checks that the
Horovod allreduce Average equals the NumPy mean of all ranks' tensors, so a
rank that silently got its own tensor back (no communication) fails.

Usage: horovodrun -np 2 --gloo -H localhost:2 python allreduce_check.py 2
"""

import sys

# Keras 3 breaks horovod.tensorflow.keras; the plain TF API is what we use.
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf


def rank_tensor(rank):
    """The tensor rank `rank` contributes: shape (2, 3), distinct per rank."""
    base = np.arange(6, dtype=np.float32).reshape(2, 3)  # (2, 3)
    return base * (rank + 1) + 10.0 * rank


def main():
    expected_size = int(sys.argv[1])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if size != expected_size:
        raise SystemExit(
            f"rank {rank}: hvd.size() is {size}, expected {expected_size}"
        )

    local = tf.constant(rank_tensor(rank))
    averaged = hvd.allreduce(local, op=hvd.Average, name="allreduce_check")
    expected = np.mean(np.stack([rank_tensor(r) for r in range(size)]), axis=0)

    np.testing.assert_allclose(averaged.numpy(), expected, rtol=0, atol=1e-6)
    # The identity check above would also pass for size 1; make sure the
    # result is not simply this rank's own tensor.
    if np.allclose(averaged.numpy(), rank_tensor(rank)):
        raise SystemExit(f"rank {rank}: allreduce returned the local tensor")
    print(f"rank {rank}/{size} allreduce OK", flush=True)


if __name__ == "__main__":
    main()
