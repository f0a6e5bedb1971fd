"""Model FLOPs per token and a measured matmul peak, for MFU.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, appendix B) divides
the FLOPs the model needs by the time taken, against the hardware's peak:

    flops_per_token = 6 * N + 12 * num_layers * hidden_dim * seq_len

N counts the parameters that take part in matrix multiplications: every
parameter except the position table, with the token embedding counted once
as the output projection (tied) or not at all (untied, where `lm_head` is
counted instead). 6N is the forward (2N) and backward (4N) cost of those
matmuls; the second term is attention's QK^T and AV products, counted over
the full sequence as PaLM does (causal masking is not subtracted).
Recomputation is not counted: MFU measures useful work.

Encoders (BERT, ALBERT) use the same formula with N = num_layers x
(4 C^2 + 2 C I), the attention and feed-forward matmuls each layer runs
(ALBERT runs its shared layers num_layers times), plus ALBERT's E x C
embedding projection. The masked-LM head (on ~15% of positions) and the
pooler (once per sequence) are left out, a few percent at most.
"""

import time

import tensorflow as tf


def matmul_parameters(model):
    """N in 6N: the parameters used in a matmul for every token."""
    count = model.count_params()
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
        parameters, layers, hidden = matmul_parameters(model), model.num_layers, model.hidden_dim
    return 6 * parameters + 12 * layers * hidden * sequence_length


def measure_matmul_peak(dtype="float32", size=2048, seconds=1.0):
    """FLOP/s of a chain of `size` x `size` matmuls: the reachable peak here.

    Runs for about `seconds` after one warm-up call, on the current
    threading settings, so it measures what this worker can get.
    """
    a = tf.random.normal([size, size], dtype="float32")
    a = tf.cast(a / size**0.5, dtype)
    chain = 8

    @tf.function
    def run(x):
        for _ in range(chain):
            x = tf.matmul(x, a)
        return x

    run(a).numpy()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run(a).numpy()
        calls += 1
    elapsed = time.perf_counter() - start
    return calls * chain * 2 * size**3 / elapsed
