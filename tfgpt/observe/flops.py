"""Model FLOPs per token and a measured matmul peak, for MFU.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, appendix B) divides
the FLOPs the model needs by the time taken, against the hardware's peak:

    flops_per_token = 6 * N + 12 * num_layers * attention_width * seq_len

N counts the parameters that take part in matrix multiplications: every
parameter except the position table (a rotary decoder has none), with the
token embedding counted once
as the output projection (tied) or not at all (untied, where `lm_head` is
counted instead). 6N is the forward (2N) and backward (4N) cost of those
matmuls; the second term is attention's QK^T and AV products, counted over
the full sequence as PaLM does (causal masking is not subtracted), at the
width of the query heads (`num_heads x head_dim`, the hidden width unless
a config sets `head_dim`; grouped-query attention shares keys and values,
not products, so its queries count in full). A gated feed-forward network's
third matrix is in N.
Recomputation is not counted: MFU measures useful work.

Encoders (BERT, ALBERT) use the same formula with N = num_layers x
(4 C^2 + 2 C I), the attention and feed-forward matmuls each layer runs
(ALBERT runs its shared layers num_layers times), plus ALBERT's E x C
embedding projection. The masked-LM head (on ~15% of positions) and the
pooler (once per sequence) are left out, a few percent at most.

The peak is measured once per machine and kept (`cached_matmul_peak`):
measuring takes seconds of every run's start-up, and one figure for a
machine keeps the MFU of its runs comparable.
"""

import hashlib
import json
import os
import platform
import tempfile
import time

import tensorflow as tf

from tfgpt.graph_function import graph_function
from tfgpt.parallel.tensor_parallel import whole_parameters


def matmul_parameters(model):
    """N in 6N: the parameters used in a matmul for every token (of the whole model)."""
    count = whole_parameters(model)  # a tensor-parallel slice: its whole model's
    if model.embeddings.position_embedding is not None:
        count -= model.max_sequence_length * model.hidden_dim  # position lookup
    if not model.tie_embeddings:
        count -= model.vocabulary_size * model.hidden_dim  # token lookup
    return count


def encoder_matmul_parameters(backbone):
    """N in 6N for a BERT or ALBERT backbone (see the module docstring)."""
    hidden, intermediate = backbone.hidden_dim, backbone.intermediate_dim
    count = backbone.num_layers * (4 * hidden * hidden + 2 * hidden * intermediate)
    embedding_dim = getattr(backbone, "embedding_dim", None)
    if embedding_dim is not None:
        count += embedding_dim * hidden
    return count


def flops_per_token(model, sequence_length):
    """Training FLOPs per token (forward and backward) of a GPT, BERT or ALBERT."""
    backbone = getattr(model, "backbone", None)
    if backbone is not None:
        parameters, layers, hidden = (
            encoder_matmul_parameters(backbone), backbone.num_layers, backbone.hidden_dim
        )
    else:
        parameters, layers = matmul_parameters(model), model.num_layers
        hidden = model.num_heads * model.config.key_width
    return 6 * parameters + 12 * layers * hidden * sequence_length


def measure_matmul_peak(dtype="float32", towers=1, sizes=(1024, 2048), seconds=2.0):
    """FLOP/s of `towers` matmul chains side by side: the peak this worker reaches.

    A worker with K towers runs K independent chains of ops in one graph,
    each op on its intra-op threads (threads / K,
    `tfgpt.parallel.cpu_threads.configure_cpu_threads`). The peak is
    measured the same way: K independent chains of `size` x `size`
    matmuls in one `tf.function`, on the current threading settings. One
    chain on one tower's threads would measure a fraction of the worker
    and let MFU read above 1. Each size in `sizes` is timed call by call for
    about `seconds / len(sizes)` after a warm-up call, and the fastest
    call's rate over all sizes is the peak: a cross-check, since a size
    that fits the caches badly reads low, and the fastest call rather than
    the mean, since other processes on a shared machine take cores away
    from some calls (a mean then under-reads the peak and MFU over-reads).

    Args:
        dtype: str. The matmul dtype ("float32", "bfloat16", "float16").
        towers: int. Chains run side by side, as the worker's towers run.
        sizes: tuple of int. Square matrix sizes to try.
        seconds: float. Time to spend measuring, over all sizes.

    Returns:
        float, FLOP/s.

    Example:
    >>> peak = measure_matmul_peak("float32", towers=2, sizes=(256,), seconds=0.05)
    >>> peak > 0
    True
    """
    if isinstance(towers, bool) or not isinstance(towers, int) or towers < 1:
        raise ValueError(f"`towers` must be a positive integer. Received: towers={towers!r}")
    if not sizes or any(not isinstance(size, int) or size < 1 for size in sizes):
        raise ValueError(
            f"`sizes` must be positive integers. Received: sizes={sizes!r}"
        )
    return max(_chains_rate(dtype, towers, size, seconds / len(sizes)) for size in sizes)


def _chains_rate(dtype, towers, size, seconds):
    """FLOP/s of `towers` independent chains of `size` x `size` matmuls."""
    length = 4
    # One matrix per chain, so that no chain waits on another's input.
    starts = [
        tf.cast(tf.random.normal([size, size], seed=tower) / size**0.5, dtype)
        for tower in range(towers)
    ]

    @graph_function
    def run(matrices):
        outputs = []
        for a in matrices:
            x = a
            for _ in range(length):
                x = tf.matmul(x, a)  # (size, size)
            outputs.append(x)
        return outputs

    def call():
        for output in run(starts):
            output.numpy()

    call()
    fastest, start = float("inf"), time.perf_counter()
    while fastest == float("inf") or time.perf_counter() - start < seconds:
        begin = time.perf_counter()
        call()
        fastest = min(fastest, time.perf_counter() - begin)
    return towers * length * 2 * size**3 / fastest


def cache_directory():
    """Where tfgpt keeps what it measures once per machine.

    `TFGPT_CACHE_DIR`, else `$XDG_CACHE_HOME/tfgpt`, else `~/.cache/tfgpt`.
    """
    if os.environ.get("TFGPT_CACHE_DIR"):
        return os.environ["TFGPT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tfgpt")


def processor_name():
    """The CPU's model name, with its family and model numbers where
    `/proc/cpuinfo` has them (one name covers several generations: "AMD
    EPYC" is Zen 3 as family 25 and Zen 5 as 26), else what `platform` knows."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's fields
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def _machine_key(dtype, towers):
    """What a measured peak depends on: the devices, the threads, the dtype and the towers."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count()
    gpus = [
        tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
        for gpu in tf.config.list_physical_devices("GPU")
    ]
    return {
        "processor": processor_name(), "cores": cores, "gpus": gpus,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "tensorflow": tf.__version__, "dtype": dtype, "towers": towers,
    }


def cached_matmul_peak(dtype="float32", towers=1, directory=None):
    """`measure_matmul_peak(dtype, towers=towers)` for this machine, measured once.

    The figure is kept in `directory/peak-flops/KEY.json` (default:
    `cache_directory()`), KEY a digest of what the peak depends on (the
    processor's name, the usable cores, the GPUs, the thread settings,
    TensorFlow's version, `dtype` and `towers`). A file that is missing,
    unreadable or for another key is measured again; a directory that
    cannot be written costs only the saving. Delete the file to measure
    again, or give the figure (`--peak-flops`).

    Returns:
        (float FLOP/s, str path of the file, bool whether it was measured now).
    """
    key = _machine_key(dtype, towers)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.path.join(directory or cache_directory(), "peak-flops")
    path = os.path.join(folder, f"{digest}.json")
    try:
        with open(path) as file:
            record = json.load(file)
        if record["key"] == key and float(record["flops"]) > 0:
            return float(record["flops"]), path, False
    except (OSError, ValueError, KeyError, TypeError):
        pass
    peak = measure_matmul_peak(dtype, towers=towers)
    try:
        os.makedirs(folder, exist_ok=True)
        # Ranks on one host may measure at once: each writes its own file
        # and renames it into place, so a reader sees one whole record.
        handle, partial = tempfile.mkstemp(dir=folder, suffix=".partial")
        with os.fdopen(handle, "w") as file:
            json.dump({"key": key, "flops": peak}, file)
        os.replace(partial, path)
    except OSError:
        pass
    return peak, path, True
