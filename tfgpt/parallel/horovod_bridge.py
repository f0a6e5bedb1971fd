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
Without XLA the gradients and their allreduces are one graph: the
gradients, taken in backward order (the last layers' first), go out in
buckets of a few megabytes, one grouped allreduce each, which starts when
the bucket's last gradient exists. Horovod's background thread then averages
the last layers' gradients while the backward pass is still computing the
first layers', in a dozen transfers per step rather than one per variable.
"""

import logging
import os

import keras
import tensorflow as tf

from tfgpt.config.distribution import HorovodOptions
from tfgpt.config.training import ALLREDUCE_BUCKET_MB
from tfgpt.graph_function import graph_function
from tfgpt.parallel import shared_memory
from tfgpt.parallel.cpu_threads import configure_cpu_threads, resolve_towers
from tfgpt.parallel.local import LocalDistribution, device_settings
from tfgpt.parallel.state import ParallelState
from tfgpt.parallel.tensor_parallel import TensorSlice, slice_scope

_COMPRESSIONS = ("none", "fp16")


# Horovod's background thread negotiates with the other ranks once per
# cycle, even when no tensor is waiting. At the default 1 ms that is about
# 1,000 loopback round trips a second per worker, ~10-20% of a core taken
# from the training thread when each worker has one core to itself. A
# step averages its gradients once, so a longer cycle costs at most one
# cycle of latency per step. Only applied when the environment (or
# `horovodrun --cycle-time-ms`) does not set it.
_DEFAULT_CYCLE_TIME_MS = "10"
# A pipeline's ticks wait for each other's transfers one after the other,
# each at least one cycle (10.2 ms per hop at 10 ms, 1.1 ms at 1 ms, measured
# on a 2-rank 1F1B step): pipeline runs take 1 ms unless told otherwise.
_PIPELINE_CYCLE_TIME_MS = "1"
# With the gradients averaged in shared memory, Horovod only carries a few
# collectives per logging window, and its idle cycles are what it costs:
# 50 ms lifted 2-worker gpt-mini scaling from 0.88-0.94 to 0.95-0.96 on 2
# cores (bench/RESULTS.md).
_SHARED_MEMORY_CYCLE_TIME_MS = "50"


def default_cycle_time(options, environ=os.environ):
    """The `HOROVOD_CYCLE_TIME` a run of `options` takes unless one is set:
    1 ms for a pipeline, 50 with the shared-memory average in prospect (the
    world as horovodrun's environment describes it, before Horovod starts),
    10 otherwise."""

    if options.pipeline_parallel > 1:
        return _PIPELINE_CYCLE_TIME_MS
    if options.allreduce_transport != "horovod" and not shared_memory.unavailable_reason(
            options, int(environ.get("HOROVOD_SIZE", 1)),
            int(environ.get("HOROVOD_LOCAL_SIZE", 1)),
            bool(tf.config.list_physical_devices("GPU"))):
        return _SHARED_MEMORY_CYCLE_TIME_MS
    return _DEFAULT_CYCLE_TIME_MS


def gradient_buckets(gradients, bucket_bytes):
    """Cuts gradients into allreduce buckets, from the last one back.

    Args:
        gradients: list of tensors with `shape` and `dtype`.
        bucket_bytes: int. A bucket closes once it holds at least this
            many bytes; 0 gives one bucket per gradient. A gradient of
            unknown size closes its bucket.

    Returns:
        Lists of indices into `gradients`, covering each once: the first
        bucket holds the last gradients, and indices fall within a bucket.

    Example:
    >>> gradient_buckets([tf.zeros([2]), tf.zeros([2]), tf.zeros([4])], 16)
    [[2], [1, 0]]
    """
    buckets, bucket, size = [], [], 0
    for index in reversed(range(len(gradients))):
        bucket.append(index)
        elements = gradients[index].shape.num_elements()
        if elements is None:
            size = bucket_bytes
        else:
            size += elements * gradients[index].dtype.size
        if size >= bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


class HorovodDistribution(LocalDistribution):
    """Data parallelism over the processes that `horovodrun` started.

    Args:
        compression: str. `"none"`, or `"fp16"` to send gradients as
            float16 over the wire (halves allreduce traffic).
        bucket_mb: float. Megabytes of gradients per grouped allreduce
            (`allreduce_gradients`); 0 sends each gradient on its own.
            Each Horovod operation costs a negotiation round and wake-ups
            of Horovod's and Gloo's threads, CPU time the training thread
            loses when workers share cores; one operation for all
            gradients would wait for the whole backward pass. The default,
            3 MB, cuts gpt-mini's 46 MB (76 gradients) into 10 buckets.
        tensor_parallel: int. T: consecutive ranks that split each block
            (`tfgpt.parallel.tensor_parallel`); must divide the ranks.
        pipeline_parallel: int. P: pipeline stages.
        zero_stage: int. ZeRO's stage, 0-3 (`tfgpt.parallel.zero`).

    Each process is one worker with one replica: `scope()`, `run()` and
    `distribute_dataset()` are the single-process ones, with this rank's
    part of the data. With `tensor_parallel` T > 1, the N ranks are laid
    out as `state` (`tfgpt.parallel.state.ParallelState`): `size` is
    the N / T data-parallel replicas, the ranks of a tensor group read the
    same batches, gradients are averaged over the data group only, and
    models built in `scope()` hold this rank's `tensor_slice`.

    Example (under `horovodrun -np 2 python script.py`):
    >>> distribution = HorovodDistribution()
    >>> distribution.size
    2
    """

    def __init__(self, compression="none", bucket_mb=ALLREDUCE_BUCKET_MB, tensor_parallel=1,
                 pipeline_parallel=1, zero_stage=0):
        if compression not in _COMPRESSIONS:
            raise ValueError(
                f"`compression` must be one of {_COMPRESSIONS}. "
                f"Received: compression={compression!r}"
            )
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not (
            bucket_mb >= 0
        ):
            raise ValueError(
                "`bucket_mb` must be a non-negative number. "
                f"Received: bucket_mb={bucket_mb!r}"
            )
        self.bucket_bytes = int(bucket_mb * 2**20)
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
        if tensor_parallel > 1 or pipeline_parallel > 1:
            # The tensor, pipeline and data groups are added once the ranks are known.
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        hvd.init()
        self._tensor_parallel = tensor_parallel
        self._pipeline_parallel = pipeline_parallel
        self._zero_stage = zero_stage
        self.read_world()
        self._compression = (
            hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        )

    def read_world(self):
        """Takes this worker's rank and the world's size from Horovod.

        At start, and again after an elastic run re-formed (workers lost
        or added): every traced step that used the old size must then be
        traced again (`allreduce_gradients` leaves one worker's gradients
        as they are; the learning rate may scale with the size).
        """
        hvd = self._hvd
        self.rank = hvd.rank()
        self.num_workers = hvd.size()
        tensor_parallel = self._tensor_parallel  # --elastic refuses T, P > 1
        self.state = ParallelState(hvd.size(), tensor=tensor_parallel,
                                   pipeline=self._pipeline_parallel, rank=self.rank,
                                   zero_stage=self._zero_stage)
        self.size = self.state.data
        self._data_set = None
        if tensor_parallel > 1 or self._pipeline_parallel > 1:
            sets = self.state.process_sets(hvd)
            self._data_set = self.data_process_set = sets["data"]
            self.pipeline_process_set = sets["pipeline"]
            if tensor_parallel > 1:
                self.tensor_slice = TensorSlice(hvd, sets["tensor"], tensor_parallel,
                                                self.state.tensor_index)
        self.local_rank = hvd.local_rank()
        self.local_size = hvd.local_size()
        self.is_chief = self.rank == 0

    @classmethod
    def create(cls, options=None, config=None):
        """Starts Horovod and configures this worker's devices for a run.

        Args:
            options: `tfgpt.config.distribution.HorovodOptions`, or None
                for the defaults.
            config: the run's config (`intra_op_threads`, `towers`,
                `batch_size`, `xla`; see `configure_devices`), or None for
                one tower on the machine's share of cores.

        `StrategyDistribution.create(options, config)` is built the same way.
        """
        options = options or HorovodOptions()
        os.environ.setdefault("HOROVOD_CYCLE_TIME", default_cycle_time(options))
        if options.elastic:
            # Horovod 0.28.1 keeps a worker's response cache (names of the
            # collectives it has negotiated, by bit) across the re-formation's
            # shutdown and init, while a worker that joins starts with none:
            # the pair then ran collectives of different sizes and Gloo
            # aborted, at every re-formation that added a worker. Without
            # the cache every collective is negotiated by name.
            os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
        distribution = cls(
            compression="fp16" if options.fp16_allreduce else "none",
            bucket_mb=options.allreduce_bucket_mb,
            tensor_parallel=options.tensor_parallel,
            pipeline_parallel=options.pipeline_parallel,
            zero_stage=options.zero_stage,
        )
        distribution.configure_devices(**device_settings(config))
        distribution.options = options
        if not options.elastic and (options.zero_stage or options.tensor_parallel > 1):
            distribution.agree_on_towers()
        distribution.choose_transport(options)
        return distribution

    def agree_on_towers(self):
        """Every rank runs the fewest towers any rank chose.

        Each rank chooses its towers from its own threads (its host's cores
        over its workers there), so hosts of different sizes choose
        differently. A data-parallel step may differ in towers (its
        collectives come after them, named alike); a ZeRO-3 or
        tensor-parallel step runs collectives inside each tower's forward
        pass, so ranks with 2 and 1 towers wait for each other forever, and
        ZeRO's gradient reduce-scatters take the names of the gradients,
        which the towers change (Horovod 0.28.1's `grouped_reducescatter`
        takes no name of its own).
        """
        if self.num_workers == 1:
            return
        towers = self._hvd.allgather(tf.constant([self.towers], tf.int32),
                                     name="tfgpt_towers").numpy()
        self.towers = int(towers.min())

    # Averages the float32 gradients of a step when not None
    # (`tfgpt.parallel.shared_memory`); `averaging` says how, for the
    # start-up line.
    _shared = None
    _shared_required = False
    averaging = "Horovod allreduce"

    def choose_transport(self, options):
        """Takes shared memory for the gradient average where
        `options.allreduce_transport` and the run allow it.

        Raises:
            ValueError: `shared-memory` asked for where it cannot work.
        """

        if options.allreduce_transport == "horovod":
            return
        gpus = bool(tf.config.get_visible_devices("GPU"))
        reason = shared_memory.unavailable_reason(options, self.num_workers, self.local_size,
                                                  gpus)
        if reason:
            if options.allreduce_transport == "shared-memory":
                raise ValueError(
                    f"--allreduce-transport shared-memory cannot average this run's gradients: "
                    f"{reason}; use --allreduce-transport auto or horovod"
                )
            if self.num_workers > 1:
                self.averaging = f"Horovod allreduce (not shared memory: {reason})"
            return
        self._shared = shared_memory.SharedMemoryAllreduce(
            self._hvd, timeout_seconds=options.collective_timeout)
        self._shared_required = options.allreduce_transport == "shared-memory"
        self.averaging = f"shared memory ({self.num_workers} workers on one host)"

    def scope(self):
        """Where the model is built: in this rank's tensor slice, if any."""
        return slice_scope(self.tensor_slice)

    def data_shard(self):
        """`(data replica, replicas)`: a tensor group and a pipeline read one replica's batches."""
        return self.state.coordinates(self.rank)[0], self.state.data

    # With a pipeline: the Horovod process set of this rank's pipeline, ranks
    # in stage order, and that of the replicas of its stage (None with one
    # pipeline).
    pipeline_process_set = None
    data_process_set = None

    def configure_devices(self, intra_op_threads=0, *, towers=1, batch_size=0, xla=False):
        """Pins one GPU per local rank; splits CPU cores among local ranks.

        `towers`, `batch_size` and `xla` choose how many towers this
        worker runs (`tfgpt.parallel.cpu_threads.resolve_towers`; 0
        chooses) and its threads are split for them; the choice is kept in
        `self.towers`. Must run before TensorFlow executes its first op.
        """
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            gpu = gpus[self.local_rank % len(gpus)]
            tf.config.experimental.set_memory_growth(gpu, True)
            tf.config.set_visible_devices(gpu, "GPU")
        threads = intra_op_threads or max(1, (os.cpu_count() or 1) // self.local_size)
        self.towers = resolve_towers(towers, threads, batch_size, xla, gpu=bool(gpus))
        # Inter-op threads beyond a couple only add contention when several
        # workers share the cores.
        configure_cpu_threads(threads, self.towers, inter_op_threads=min(2, threads))

    def allreduce_gradients(self, gradients):
        """Averages a list of dense gradients over all workers, in buckets.

        `gradients` come in the order of the model's variables, so the
        backward pass computes them roughly last to first. They are cut,
        from the end, into buckets of at least `bucket_bytes` (one per
        gradient when 0), and each bucket is one `hvd.grouped_allreduce`,
        enqueued in a graph as soon as its last gradient is computed. The
        sums are the ones one allreduce of all gradients would give (bit
        for bit with two workers, whose sum does not depend on the order;
        with more, Gloo's ring may add in another order, a float32
        round-off difference).

        With the shared-memory transport (`choose_transport`) the float32
        gradients are averaged instead in one call after the backward pass
        (`tfgpt.parallel.shared_memory`).

        One worker's gradients are their own average: they are returned
        as they are, without Horovod, whose background thread would hold
        the step up to one `HOROVOD_CYCLE_TIME` for the last bucket (3.9%
        of a gpt-mini step on 2 cores, bench/RESULTS.md).

        Returns:
            The averaged gradients, in the order given.
        """
        if self.size == 1:
            return list(gradients)
        if self._shared is not None:
            return self._average_in_shared_memory(gradients)
        return self._average_with_horovod(gradients)

    def _average_with_horovod(self, gradients):
        # Under tensor parallelism: over the data group (every gradient of a
        # tensor group's ranks is already whole, `tensor_parallel`).
        where = {} if self._data_set is None else {"process_set": self._data_set}
        averaged = [None] * len(gradients)
        for bucket in gradient_buckets(gradients, self.bucket_bytes):
            # Horovod pairs the ranks' collectives by name, and by default
            # names a grouped allreduce after its tensors, which are names in
            # this worker's graph: a worker with 2 towers averages `AddN_45`,
            # the sum of its towers, where one with 1 tower (started beside
            # another on its host: fewer threads) averages a `gradient_tape/`
            # tensor, and both wait for the other's forever. The bucket's
            # place in the gradient list is the same on every worker.
            reduced = self._hvd.grouped_allreduce(
                [gradients[index] for index in bucket],
                op=self._hvd.Average,
                compression=self._compression,
                name=f"gradients_{bucket[-1]}_to_{bucket[0]}",
                **where,
            )
            for index, gradient in zip(bucket, reduced):
                averaged[index] = gradient
        return averaged

    def _average_in_shared_memory(self, gradients):
        """The float32 gradients of known shape in one shared-memory call, the
        others (if any) through Horovod."""
        gradients = [tf.convert_to_tensor(g) for g in gradients]
        shared = [i for i, g in enumerate(gradients)
                  if g.dtype == tf.float32 and g.shape.is_fully_defined()]
        if not shared:  # the op takes at least one tensor
            return self._average_with_horovod(gradients)
        try:
            averaged = self._shared([gradients[i] for i in shared])
        except RuntimeError as error:  # the same on every rank
            if self._shared_required:
                raise
            self._shared = None
            self.averaging = f"Horovod allreduce ({error})"
            logging.getLogger("tfgpt.parallel").warning(
                "%s: averaging through Horovod, at HOROVOD_CYCLE_TIME %s ms (10 suits it "
                "better)", error, os.environ.get("HOROVOD_CYCLE_TIME"))
            return self._average_with_horovod(gradients)
        result = list(gradients)
        for index, value in zip(shared, averaged):
            result[index] = value
        rest = sorted(set(range(len(gradients))) - set(shared))
        if rest:
            for index, value in zip(rest, self._average_with_horovod(
                    [gradients[i] for i in rest])):
                result[index] = value
        return result

    def one_batch_per_group(self, batches, every_step=False):
        """Yields `batches`, checked to be one batch across each group that
        computes on one.

        The ranks of a tensor group compute one forward pass on one batch,
        and the stages of a pipeline read the inputs (the first) and the
        targets (the last) of one batch: they read the same input pipeline
        in a deterministic order. At the first step (every step with
        `every_step`) a fingerprint of the batch is compared across both
        groups (`check_one_batch`), so that ranks that read different
        batches stop with one line naming them instead of training on two
        inputs. (A broadcast of each batch from the group's first rank, as
        Megatron-LM's `broadcast_data` does, ran eagerly outside the step
        and held a survivor forever once its peer died.)
        """
        if not self.state.split:
            yield from batches  # every rank computes on its own batches
            return
        for step, batch in enumerate(batches, 1):
            if step == 1 or every_step:
                self.check_one_batch(batch, step)
            yield batch

    def check_one_batch(self, batch, step):
        """Raises ValueError, in one line naming the ranks, unless this rank's
        tensor group and pipeline hold the same `batch` (a fingerprint each,
        one allgather per group)."""
        values = [tf.reshape(tf.cast(value, tf.float64), [-1]) for value in tf.nest.flatten(batch)]
        weights = [tf.cast(tf.range(tf.size(value)) % 9973 + 1, tf.float64) for value in values]
        fingerprint = tf.add_n([tf.reduce_sum(value * weight)
                                for value, weight in zip(values, weights)])
        tensor_set = self.tensor_slice.process_set
        for kind, group, process_set in (
                ("tensor group", self.state.tensor_group(), tensor_set),
                ("pipeline", self.state.pipeline_group(), self.pipeline_process_set)):
            if process_set is None:
                continue
            prints = self._hvd.allgather(tf.reshape(fingerprint, [1]),
                                         process_set=process_set).numpy()
            if len(set(prints.tolist())) > 1:
                found = ", ".join(f"rank {rank}: {value:.0f}" for rank, value in zip(group, prints))
                raise ValueError(
                    f"the ranks {group} of one {kind} hold different batches at step {step} "
                    f"(fingerprints {found}): they must compute on one batch")

    def replica_sum(self, value):
        """The exact sum of a float32 tensor over the data replicas, inside a step
        (the ranks of a tensor group or a pipeline hold one batch: counted once)."""
        if self.size == 1:
            return value
        return self._hvd.allreduce(value, op=self._hvd.Sum, name="replica_sum",
                                   process_set=self.data_process_set or
                                   self._hvd.global_process_set)

    def allreduce_mean(self, value):
        """Averages a tensor over all workers: a float32 one through shared
        memory when the gradients go there (microseconds, where Horovod's
        allreduce waits up to its cycle time, 50 ms in such runs: the
        preemption check after every step, the logging window's means and
        the checkpoint barriers)."""
        value = tf.convert_to_tensor(value)
        if self._shared is not None and value.dtype == tf.float32:
            return self._average_in_shared_memory([value])[0]
        return self._hvd.allreduce(value, op=self._hvd.Average, name=None)

    def broadcast_variables(self, variables):
        """Overwrites `variables` (Keras or tf.Variables) with rank 0's values.

        Under tensor or pipeline parallelism, with the values of the first
        rank of this rank's data group (the same slice of the same stage): a
        sum over the group to which only that rank contributes.
        """
        tf_variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
        if not self.state.split:  # every rank holds the whole model
            # Horovod's `broadcast_variables` traces the same ops with
            # AutoGraph: 1.8 s of a tiny run's start-up (tfgpt.graph_function).
            @graph_function
            def broadcast():
                for variable in tf_variables:  # each assignment runs: it is stateful
                    variable.assign(self._hvd.broadcast(variable, root_rank=0))

            broadcast()
            return
        if self._data_set is None:
            return  # one replica: nothing to agree on
        first = self.state.data_group(self.rank)[0] == self.rank
        by_dtype = {}  # a grouped allreduce takes one dtype
        for variable in tf_variables:
            by_dtype.setdefault(variable.dtype, []).append(variable)
        for group in by_dtype.values():
            sums = self._hvd.grouped_allreduce(
                [tf.convert_to_tensor(v) if first else tf.zeros_like(v) for v in group],
                op=self._hvd.Sum, process_set=self._data_set,
            )
            for variable, value in zip(group, sums):
                variable.assign(value)
