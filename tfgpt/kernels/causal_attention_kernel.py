"""Causal self-attention of a fused query/key/value projection through the
`TfgptCausalAttention` kernel (float32 training path of the attention layer)."""

import tensorflow as tf

import tfgpt.kernels as kernels
from tfgpt.kernels import dispatch

# Query rows per block: block i meets keys [0, (i + 1) * BLOCK_SIZE) only,
# so for T = 256 the matmuls do 10/16 of the full work. 32-64 were the
# fastest for gpt-mini's heads (D = 64) in float32 on a 1-thread step;
# 128 and up lose most of the saving, 256 (no skipping) was slower than
# TensorFlow's own path.
BLOCK_SIZE = 64


def causal_attention_available(dtype, dropout=0.0, padding_mask=None, cache=None):
    """True when `causal_attention` can run now for a projection of `dtype`.

    Args:
        dtype: the projection's dtype. Float32 only: in bfloat16 and
            float16 oneDNN's AMX / AVX-512 matmuls outrun the kernel's
            float32 (Eigen) matmuls, so the attention layer keeps
            TensorFlow's ops there.
        dropout: float. The attention dropout in effect (0 outside training).
        padding_mask, cache: the attention layer's, or None (the kernel
            masks causally, within packed examples' segments when given
            `segment_ids`, and nothing else).

    The rules are `tfgpt.kernels.dispatch`'s ("attention").
    """
    return dispatch.runs(
        "attention", dtype, dropout=dropout,
        masked=padding_mask is not None or cache is not None,
    )


def causal_attention(qkv, num_heads, segment_ids=None):
    """Multi-head causal self-attention of a (B, T, 3C) projection.

    Args:
        qkv: float32 tensor (B, T, 3C), laid out (B, T, 3, H, D): the
            queries, keys and values of H = `num_heads` heads of width
            D = C / H, as one dense layer projects them (GPT-2's `c_attn`).
        num_heads: int.
        segment_ids: optional int tensor (B, T): each position's example in
            a packed row (`tfgpt.layers.segments`); position i then attends
            to the positions j <= i of its own example only.

    Returns:
        float32 tensor (B, T, C): for each head softmax(Q K^T / sqrt(D))
        V with position i attending to positions <= i, heads side by side
        (ready for the output projection).

    One kernel reads the heads out of `qkv` with strides, skips the score
    blocks the mask would discard and writes the result in (B, T, C); its
    gradient is one kernel too. With segment ids, a query block also skips
    the keys before the earliest example its queries are in. Raises if the
    kernel cannot run (check `causal_attention_available` first).

    Example:
    >>> out = causal_attention(tf.zeros([1, 3, 12]), num_heads=2)  # C = 4
    >>> out.shape
    TensorShape([1, 3, 4])
    """
    qkv = tf.convert_to_tensor(qkv)
    reason = dispatch.reason("attention", qkv.dtype)
    if reason:
        raise RuntimeError(f"the fused causal attention kernel cannot run: {reason}")
    # The op's optional input: a list of no tensor or one.
    segments = [] if segment_ids is None else [tf.cast(segment_ids, "int32")]
    output, _ = kernels.library().tfgpt_causal_attention(
        qkv, segments, num_heads=num_heads, block_size=BLOCK_SIZE
    )
    return output


@tf.RegisterGradient("TfgptCausalAttention")
def _causal_attention_gradient(op, doutput, _):
    # The packed weights are an internal output, kept for this gradient.
    segments = list(op.inputs[1:])  # [] or [segment_ids (B, T)]
    dqkv = kernels.library().tfgpt_causal_attention_grad(
        doutput,
        op.inputs[0],
        op.outputs[1],
        segments,
        num_heads=op.get_attr("num_heads"),
        block_size=op.get_attr("block_size"),
    )
    return [dqkv] + [None] * len(segments)
