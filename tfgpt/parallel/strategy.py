"""tf.distribute strategies behind the trainer core's distribution interface."""

import json
import os

import tensorflow as tf

from tfgpt.config.distribution import STRATEGIES, StrategyOptions
from tfgpt.parallel.cpu_threads import configure_cpu_threads, resolve_towers
from tfgpt.parallel.local import LocalDistribution, device_settings
from tfgpt.parallel.state import ParallelState


def make_strategy(name):
    """Returns the tf.distribute strategy called `name` (see STRATEGIES).

    `multi-worker` reads the cluster from the `TF_CONFIG` environment
    variable, one process per worker.
    """
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one-device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if name == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        cpus = tf.config.list_logical_devices("CPU")
        # Without GPUs, every logical CPU device is a replica (tests split
        # the CPU into several with tf.config.set_logical_device_configuration).
        return tf.distribute.MirroredStrategy(
            [d.name for d in gpus] if gpus else [d.name for d in cpus]
        )
    if name == "multi-worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    raise ValueError(f"`strategy` must be one of {STRATEGIES}. Received: strategy={name!r}")


class StrategyDistribution(LocalDistribution):
    """Data parallelism through a `tf.distribute.Strategy`.

    Replicas average their gradients with the replica context's all-reduce
    inside the compiled step, then clip and update: the same order as the
    Horovod path, so both give the same numbers.

    Args:
        strategy: tf.distribute.Strategy.

    Example:
    >>> distribution = StrategyDistribution(make_strategy("mirrored"))
    >>> distribution.size  # replicas in sync
    1
    """

    @classmethod
    def create(cls, options=None, config=None):
        """Configures the devices, then builds the strategy `options` names.

        Args:
            options: `tfgpt.config.distribution.StrategyOptions`, or None
                for the defaults (mirrored, no logical CPUs).
            config: the run's config (`intra_op_threads`, `towers`,
                `batch_size`, `xla`), or None for one tower on the
                machine's share of cores.

        Workers that share a machine (multi-worker on one host, read from
        `TF_CONFIG`) split its cores, as Horovod's ranks do;
        `logical_cpus` > 1 splits the CPU into that many replicas. The
        towers each replica runs are chosen from `config`
        (`tfgpt.parallel.cpu_threads.resolve_towers`; 0 chooses).
        `HorovodDistribution.create(options, config)` is built the same way.
        """
        options = options or StrategyOptions()
        settings = device_settings(config)
        cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
        hosts = [address.rsplit(":", 1)[0] for address in cluster.get("worker", [])]
        workers_here = max(1, sum(host in ("localhost", "127.0.0.1") for host in hosts))
        threads = settings["intra_op_threads"] or max(1, (os.cpu_count() or 1) // workers_here)
        towers = resolve_towers(settings["towers"], threads, settings["batch_size"],
                                settings["xla"], replicas=max(1, options.logical_cpus))
        configure_cpu_threads(threads, towers)
        if options.logical_cpus > 1:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * options.logical_cpus
            )
        distribution = cls(make_strategy(options.strategy))
        distribution.towers = towers
        distribution.options = options
        return distribution

    def __init__(self, strategy):
        self.strategy = strategy
        self.size = strategy.num_replicas_in_sync
        self.num_workers = getattr(strategy.extended, "_num_workers", 1)
        resolver = getattr(strategy, "cluster_resolver", None)
        task_id = resolver.task_id if resolver is not None and resolver.task_type else 0
        self.rank = int(task_id or 0)
        self.is_chief = self.rank == 0
        # Each worker holds the whole model; its replicas are in-process.
        self.state = ParallelState(size=self.num_workers, rank=self.rank)

    def scope(self):
        return self.strategy.scope()

    def distribute_dataset(self, dataset_fn):
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    def run(self, replica_fn, batch):
        results = self.strategy.run(replica_fn, args=(batch,))
        return tf.nest.map_structure(
            lambda value: self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None),
            results,
        )

    def configure_optimizer(self, optimizer):
        # Keras 3 optimizers sum gradients across replicas inside apply(),
        # after clipping. The step has already averaged them, so that sum
        # would count every gradient num_replicas times (and clip before
        # averaging); switch it off for this optimizer and its inner one.
        for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if target is not None:
                target._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
        return optimizer

    def allreduce_gradients(self, gradients):
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.MEAN, list(gradients))

    def replica_sum(self, value):
        """The sum of a tensor over the replicas, inside a step."""
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)

    def allreduce_mean(self, value):
        """Averages a value computed on every worker (outside a step)."""
        value = tf.convert_to_tensor(value)
        if self.strategy.extended._in_multi_worker_mode():
            per_replica = self.strategy.run(lambda: tf.identity(value))
            return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)
        return value

    def broadcast_variables(self, variables):
        # Mirrored variables start equal on every replica (MultiWorkerMirrored
        # broadcasts the chief's initial values itself).
        del variables
