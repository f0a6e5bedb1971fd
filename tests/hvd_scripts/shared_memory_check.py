"""Run under horovodrun: the shared-memory gradient average against its inputs.

Usage: shared_memory_check.py OUT average|peer-exits

average: each rank averages tensors of awkward shapes (a scalar, an empty
one, sizes no chunk boundary falls on), 30 times with new values, then a
larger list (the segment is mapped again); writes every input and output
to OUT/rank-R.npz with the segment files left in /dev/shm, and, with two
ranks, the weights after 4 TrainSteps averaged by Horovod and by shared
memory from the same start.

peer-exits: rank 1 exits after the segment is mapped; rank 0's next call
must end with an error naming it; rank 0 prints what it got and how long
it waited.
"""

import os
import sys
import time

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from tfgpt import GPT
from tfgpt.config.distribution import HorovodOptions
from tfgpt.parallel.horovod_bridge import HorovodDistribution
from tfgpt.parallel.shared_memory import SharedMemoryAllreduce, segment_path
from tfgpt.training.train_step import TrainStep

SHAPES = [(), (0,), (7,), (3, 5), (1001,)]


def train(distribution, seed_batches):
    keras.utils.set_random_seed(7)
    model = GPT(vocabulary_size=29, num_layers=2, num_heads=2, hidden_dim=8,
                intermediate_dim=12, max_sequence_length=8)
    optimizer = keras.optimizers.Adam(learning_rate=0.01)
    optimizer.build(model.trainable_variables)
    step = TrainStep(model, optimizer, distribution)
    for inputs, targets in seed_batches:
        step(inputs, targets)
    return [v.numpy() for v in model.trainable_variables]


def average(out):
    rank = hvd.rank()
    rng = np.random.default_rng(rank)
    average = SharedMemoryAllreduce(hvd)
    shared = tf.function(average)
    saved = {}
    for call in range(30):
        inputs = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
        outputs = shared([tf.constant(x) for x in inputs])
        for index, (x, y) in enumerate(zip(inputs, outputs)):
            saved[f"in_{call}_{index}"], saved[f"out_{call}_{index}"] = x, y.numpy()
    larger = [rng.standard_normal((5000,)).astype(np.float32), *inputs]
    outputs = shared([tf.constant(x) for x in larger])
    for index, (x, y) in enumerate(zip(larger, outputs)):
        saved[f"in_larger_{index}"], saved[f"out_larger_{index}"] = x, y.numpy()
    saved["segment_left"] = np.array(os.path.exists(segment_path(average.key)))

    if hvd.size() == 2:
        batches = [(rng.integers(0, 29, (3, 6)).astype("int32"),
                    rng.integers(0, 29, (3, 6)).astype("int32")) for _ in range(4)]
        distribution = HorovodDistribution()
        saved["horovod_averaged"] = np.array(distribution.averaging)
        for index, value in enumerate(train(distribution, batches)):
            saved[f"horovod_{index}"] = value
        distribution.choose_transport(HorovodOptions(allreduce_transport="shared-memory"))
        saved["shared_averaged"] = np.array(distribution.averaging)
        for index, value in enumerate(train(distribution, batches)):
            saved[f"shared_{index}"] = value
    np.savez(os.path.join(out, f"rank-{rank}.npz"), **saved)


def peer_exits():
    shared = tf.function(SharedMemoryAllreduce(hvd, timeout_seconds=120))
    shared([tf.ones([4])])  # maps the segment on both ranks
    if hvd.rank() == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        shared([tf.ones([4])])
        print("rank 0: no error")
    except tf.errors.AbortedError as error:
        print(f"rank 0 aborted after {time.monotonic() - start:.1f} s: {' '.join(error.message.split())}")


if __name__ == "__main__":
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if sys.argv[2] == "average":
        average(sys.argv[1])
    else:
        peer_exits()
