"""Gradient averaging through shared memory, for Horovod workers on one host.

Horovod's Gloo allreduce sends every byte through the kernel's TCP loopback
and waits for its background thread's next cycle: for gpt-mini's 46 MB of
gradients on two workers of a 2-core machine that is 66-75 ms of wall time
and 30-36 ms of CPU per rank and step (bench/RESULTS.md). Workers on one
host can instead share one memory segment: each copies its gradients in,
sums its chunk of everyone's after a barrier, and copies the average out
after a second one (`tfgpt/kernels/cc/shm_allreduce.cc`), about 7 ms of
memory traffic per rank. Every rank gets the same bits; with two ranks the
bits Horovod's average gives.

`--allreduce-transport auto` (the default) takes it where it applies: all
workers on one host, no GPU, plain data parallelism (no ZeRO, tensor or
pipeline parallelism, elastic run or `--fp16-allreduce`), and tfgpt's
kernel library built. `shared-memory` insists and fails with the reason
where it cannot; `horovod` never takes it.

The segment is a file under /dev/shm that every rank maps and that is
unlinked as soon as all have (a killed run leaves nothing behind); its
pages are reserved up front, so a /dev/shm too small for it (a container's
64 MiB default: `docker run --shm-size`) is found at the first step, where
`auto` falls back to Horovod with a warning. A rank that dies while another
waits for it ends the other's step with an error naming it, not a hang.

Example (under `horovodrun -np 2`, on one host):
>>> average = SharedMemoryAllreduce(hvd.rank(), hvd.size())
>>> average([tf.fill([3], float(hvd.rank()))])[0].numpy()
array([0.5, 0.5, 0.5], dtype=float32)
"""

import logging
import os
import secrets

import tensorflow as tf

from tfgpt import kernels
from tfgpt.config.distribution import COLLECTIVE_TIMEOUT_SECONDS

SEGMENT_DIRECTORY = "/dev/shm"

_logger = logging.getLogger("tfgpt.parallel")


def unavailable_reason(options, num_workers, local_size, gpus):
    """Why shared memory cannot average this run's gradients ("" when it can).

    Args:
        options: the run's `HorovodOptions`.
        num_workers, local_size: Horovod's size and the workers on this host.
        gpus: whether this worker sees a GPU.
    """
    if num_workers == 1:
        return "one worker"
    if local_size != num_workers:
        return f"{num_workers} workers on more than one host"
    if gpus:
        return "GPUs (Horovod's NCCL path keeps the gradients on the device)"
    flags = [
        (options.zero_stage, f"--zero-stage {options.zero_stage}"),
        (options.tensor_parallel > 1, f"--tensor-parallel {options.tensor_parallel}"),
        (options.pipeline_parallel > 1, f"--pipeline-parallel {options.pipeline_parallel}"),
        (options.elastic, "--elastic"),
        (options.fp16_allreduce, "--fp16-allreduce"),
    ]
    for given, flag in flags:
        if given:
            return f"{flag} averages through Horovod"
    if not os.path.isdir(SEGMENT_DIRECTORY):
        return f"no {SEGMENT_DIRECTORY}"

    if kernels.library() is None:
        return f"tfgpt's kernel library is unavailable ({kernels.unavailable_reason()})"
    return ""


def segment_path(key):
    """The file of segment `key` while its ranks map it."""
    return os.path.join(SEGMENT_DIRECTORY, f"tfgpt-allreduce-{key:016x}")


class SharedMemoryAllreduce:
    """Averages float32 tensors over the `size` workers of one host.

    Callable on a list of tensors of known shapes inside a `tf.function`
    (one op, which blocks until every rank has called it); the segment is
    mapped while the first call is traced, in two small Horovod
    collectives, so every rank must trace its calls in the same order, as
    every rank runs its Horovod collectives. A call with more elements
    than the segment holds maps a larger one.

    Args:
        hvd: `horovod.tensorflow`, initialised.
        timeout_seconds: how long a rank waits for a live peer
            (`--collective-timeout`).

    Raises (from a call's tracing):
        RuntimeError: a rank could not map the segment (the message says
            which error and on how many ranks).
    """

    def __init__(self, hvd, timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS):

        self._hvd = hvd
        self._library = kernels.library()
        self._timeout = float(timeout_seconds)
        self._key = None
        self._capacity = 0
        self._attachments = 0

    @tf.autograph.experimental.do_not_convert
    def __call__(self, tensors):
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        total = sum(int(t.shape.num_elements()) for t in tensors)
        if total > self._capacity:
            self._attach(total)
        return self._library.tfgpt_shm_allreduce(tensors, key=self._key,
                                                 timeout_seconds=self._timeout)

    @tf.autograph.experimental.do_not_convert
    def _attach(self, capacity):
        hvd = self._hvd
        rank, size = hvd.rank(), hvd.size()
        self._attachments += 1
        name = f"tfgpt_shm_{self._attachments}"
        with tf.init_scope():  # eagerly, also while a step is being traced
            token = secrets.randbits(62) if rank == 0 else 0
            key = int(hvd.broadcast(tf.constant(token, tf.int64), root_rank=0,
                                    name=name + "_key"))
            path = segment_path(key)
            error = ""
            try:
                self._library.tfgpt_shm_attach(path=path, key=key, rank=rank, size=size,
                                               capacity=capacity)
            except tf.errors.OpError as failure:
                error = failure.message
            # Also the barrier after which no rank opens the file any more.
            failed = int(hvd.allreduce(tf.constant(int(bool(error)), tf.int32), op=hvd.Sum,
                                       name=name + "_failed"))
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if failed:
            raise RuntimeError(
                f"shared-memory allreduce: {failed} of {size} rank(s) could not map a "
                f"{capacity * 4 * (size + 1) / 2**20:.0f} MiB segment in {SEGMENT_DIRECTORY} "
                f"({error or 'another rank failed'}); give /dev/shm more room (docker run "
                "--shm-size) or use --allreduce-transport horovod"
            )
        self._key, self._capacity = key, capacity

    @property
    def key(self):
        """The mapped segment's key (None before the first call)."""
        return self._key
