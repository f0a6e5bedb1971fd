"""GELU of a bias add through the fused `TfgptBiasGelu` kernel, or TensorFlow's ops."""

import tensorflow as tf

import tfgpt.kernels as kernels
from tfgpt.kernels import dispatch


def bias_gelu(x, bias, approximate=True):
    """`gelu(x + bias)`, `bias` (N,) added along the last axis of `x` (..., N).

    Args:
        x: float tensor (float32, bfloat16 or float16), e.g. a matmul output.
        bias: vector of the same dtype.
        approximate: bool. The tanh approximation when True, exact erf GELU
            when False.

    The fused kernel adds, activates and, in the backward pass, also sums
    the bias gradient in one pass over `x` (float32 math, deterministic
    block order); the composite path is a bias add and `tf.nn.gelu`.
    """
    x = tf.convert_to_tensor(x)
    if dispatch.runs("bias_gelu", x.dtype):
        return kernels.library().tfgpt_bias_gelu(x, bias, approximate=approximate)
    return tf.nn.gelu(tf.nn.bias_add(x, bias) if x.shape.rank == 2 else x + bias,
                      approximate=approximate)


@tf.RegisterGradient("TfgptBiasGelu")
def _bias_gelu_gradient(op, gradient):
    return kernels.library().tfgpt_bias_gelu_grad(
        gradient, op.inputs[0], op.inputs[1], approximate=op.get_attr("approximate")
    )
