"""GELU through the fused `TfgptGelu` kernel, or TensorFlow's composite ops."""

import tensorflow as tf

import tfgpt.kernels as kernels
from tfgpt.kernels import dispatch


def gelu(x, approximate=True):
    """GELU of `x` (Hendrycks & Gimpel 2016): `x * Phi(x)`.

    Args:
        x: float tensor (float32, bfloat16 or float16).
        approximate: bool. The tanh approximation (GPT-2's `gelu_new`)
            when True, the exact erf form when False.

    The fused kernel computes in float32 and rounds once to `x`'s dtype;
    the composite path is `tf.nn.gelu`, as `keras.activations.gelu` runs it.
    """
    x = tf.convert_to_tensor(x)
    if dispatch.runs("gelu", x.dtype):
        return kernels.library().tfgpt_gelu(x, approximate=approximate)
    return tf.nn.gelu(x, approximate=approximate)


@tf.RegisterGradient("TfgptGelu")
def _gelu_gradient(op, gradient):
    return kernels.library().tfgpt_gelu_grad(
        gradient, op.inputs[0], approximate=op.get_attr("approximate")
    )
