"""How a worker spends its CPU threads: one chain of ops, or several towers.

A GPT step on a CPU is a chain of matmuls, each split over the worker's
threads. At a small model's shapes a matmul split over two threads runs
well below twice its one-thread speed (gpt-mini, 2 cores: a one-thread
step is 0.56x a two-thread step, not 0.5x). Towers cut each batch into K
slices whose forward and backward passes are independent chains in one
graph: K ops run at once, each on threads / K threads, and the gradients
meet only where the variables' gradients are summed (`TrainStep`). On two
cores two towers of one thread each measured 1.05-1.13x the one-chain step
in float32 and 1.13-1.15x in bfloat16 (docs/training.md, --towers).
"""

import tensorflow as tf


def resolve_towers(towers, threads, batch_size=0, xla=False, replicas=1, gpu=None):
    """The number of towers a worker runs.

    Args:
        towers: int. What was asked for; 0 chooses: 2 when the worker
            computes on its CPU (no GPU) with at least 2 threads, one
            replica, XLA off (an XLA cluster runs its ops one after
            another) and an even `batch_size`; 1 otherwise.
        threads: int. CPU threads of the worker.
        batch_size: int. Sequences per replica per step; 0 when unknown
            (then 0 chooses 1).
        xla: bool. Whether the step is compiled with XLA.
        replicas: int. Replicas in this process (`--logical-cpus`).
        gpu: bool or None. Whether the worker has a GPU; None looks.

    Returns:
        int, at least 1.

    Example:
    >>> resolve_towers(0, threads=2, batch_size=8, gpu=False)
    2
    >>> resolve_towers(0, threads=1, batch_size=8, gpu=False)
    1
    """
    if isinstance(towers, bool) or not isinstance(towers, int) or towers < 0:
        raise ValueError(
            f"`towers` must be a non-negative integer. Received: towers={towers!r}"
        )
    if towers:
        return towers
    if gpu is None:
        gpu = bool(tf.config.list_physical_devices("GPU"))
    chooses_two = (
        not gpu and threads >= 2 and not xla and replicas <= 1
        and batch_size > 0 and batch_size % 2 == 0
    )
    return 2 if chooses_two else 1


def configure_cpu_threads(threads, towers=1, inter_op_threads=None):
    """Sets TensorFlow's thread pools for `towers` chains on `threads` threads.

    Each op gets `threads // towers` threads (at least one); the inter-op
    pool runs at least `towers` ops at once. With one tower the inter-op
    pool is `inter_op_threads`, or TensorFlow's default when None. Must run
    before TensorFlow executes its first op.
    """
    tf.config.threading.set_intra_op_parallelism_threads(max(1, threads // towers))
    if towers > 1:
        inter_op_threads = max(towers, inter_op_threads or 0)
    if inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
