"""Keras 3 <-> Horovod bridge for tfgpt's trainers.

Horovod 0.28.1 predates Keras 3: `horovod.tensorflow.keras` fails (its
callbacks call removed `keras.backend` functions and `Variable.ref`) and
its `DistributedOptimizer` runs under Keras 3 without averaging anything.
This module uses only `horovod.tensorflow`, on the `tf.Variable`s that
Keras 3 variables wrap (`variable.value`).

The gradients are computed first (inside an XLA cluster when `--xla` is on)
and averaged afterwards: that is what `hvd.DistributedGradientTape` does in
one call, split in two because a Horovod allreduce cannot run inside
`jit_compile=True` (there is no HorovodAllreduce kernel for XLA_CPU_JIT).
Without XLA the gradients and their allreduces are one graph, one
allreduce per gradient as `DistributedGradientTape` issues them: each
starts when its gradient exists, so Horovod's background thread averages
the last layers' gradients while the backward pass is still computing the
first layers'.
"""

import os

import keras
import tensorflow as tf

from tfgpt.distributed.local import LocalDistribution

_COMPRESSIONS = ("none", "fp16")

# Horovod's background thread negotiates with the other ranks once per
# cycle, even when no tensor is waiting. At the default 1 ms that is about
# 1,000 loopback round trips a second per worker, ~10-20% of a core taken
# from the training thread when each worker has one core to itself. A
# step averages its gradients once, so a longer cycle costs at most one
# cycle of latency per step. Only applied when the environment (or
# `horovodrun --cycle-time-ms`) does not set it.
_DEFAULT_CYCLE_TIME_MS = "10"


class HorovodDistribution(LocalDistribution):
    """Data parallelism over the processes that `horovodrun` started.

    Args:
        compression: str. `"none"`, or `"fp16"` to send gradients as
            float16 over the wire (halves allreduce traffic).

    Each process is one worker with one replica: `scope()`, `run()` and
    `distribute_dataset()` are the single-process ones, with this rank's
    part of the data.

    Example (under `horovodrun -np 2 python script.py`):
    >>> distribution = HorovodDistribution()
    >>> distribution.size
    2
    """

    def __init__(self, compression="none"):
        if compression not in _COMPRESSIONS:
            raise ValueError(
                f"`compression` must be one of {_COMPRESSIONS}. "
                f"Received: compression={compression!r}"
            )
        # Read by Horovod's background thread, which hvd.init() starts.
        os.environ.setdefault("HOROVOD_CYCLE_TIME", _DEFAULT_CYCLE_TIME_MS)
        try:
            import horovod.tensorflow as hvd
        except ImportError as error:
            raise ImportError(
                "Horovod is not installed in this environment: run `make setup`, "
                f"which builds it against the installed TensorFlow ({error})"
            ) from error
        self._hvd = hvd
        hvd.init()
        self.rank = hvd.rank()
        self.size = hvd.size()
        self.num_workers = self.size
        self.local_rank = hvd.local_rank()
        self.local_size = hvd.local_size()
        self.is_chief = self.rank == 0
        self._compression = (
            hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        )

    def configure_devices(self, intra_op_threads=0):
        """Pins one GPU per local rank; splits CPU cores among local ranks.

        Must run before TensorFlow executes its first op.
        """
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            gpu = gpus[self.local_rank % len(gpus)]
            tf.config.experimental.set_memory_growth(gpu, True)
            tf.config.set_visible_devices(gpu, "GPU")
        threads = intra_op_threads or max(1, (os.cpu_count() or 1) // self.local_size)
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # Inter-op threads beyond a couple only add contention when several
        # workers share the cores.
        tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))

    def allreduce_gradients(self, gradients):
        """Averages a list of dense gradients over all workers, one allreduce each.

        In a graph, each allreduce is enqueued as soon as its gradient is
        computed; Horovod fuses those that are waiting in the same cycle
        into one transfer. The sums are the ones one grouped allreduce
        would give (bit for bit with two workers, whose sum does not depend
        on the order; with more, Gloo's ring may add in another order, a
        float32 round-off difference).
        """
        return [
            self._hvd.allreduce(gradient, op=self._hvd.Average, compression=self._compression)
            for gradient in gradients
        ]

    def allreduce_mean(self, value):
        """Averages a tensor over all workers."""
        return self._hvd.allreduce(value, op=self._hvd.Average, name=None)

    def broadcast_variables(self, variables):
        """Overwrites `variables` (Keras or tf.Variables) with rank 0's values."""
        tf_variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
        self._hvd.broadcast_variables(tf_variables, root_rank=0)
