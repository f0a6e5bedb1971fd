"""Layer normalization through the fused `TfgptLayerNorm` kernel, or Keras's ops."""

import keras
import tensorflow as tf

import tfgpt.kernels as kernels
from tfgpt.kernels import dispatch


def layer_norm(x, gamma, beta, epsilon=1e-3):
    """Layer normalization of `x` over its last axis (Ba et al. 2016).

    `(x - mean) / sqrt(var + epsilon) * gamma + beta`, with the mean and
    biased variance of each row of the last axis.

    Args:
        x: float tensor (float32, bfloat16 or float16), shape (..., C).
        gamma: float tensor or variable, shape (C,). Scale.
        beta: float tensor or variable, shape (C,). Offset.
        epsilon: float. Added to the variance.

    Returns:
        A tensor of `x`'s shape and dtype.

    The fused kernel computes in float32 and rounds once to `x`'s dtype.
    The composite path is `keras.ops.layer_normalization`, which is what
    `keras.layers.LayerNormalization` runs (also in float32 for float16 and
    bfloat16 inputs), so with the kernels off a model computes exactly what
    it computed with Keras's layer.
    """
    x = tf.convert_to_tensor(x)
    if dispatch.runs("layer_norm", x.dtype):
        y, _, _ = kernels.library().tfgpt_layer_norm(
            x, tf.cast(gamma, tf.float32), tf.cast(beta, tf.float32), epsilon=epsilon
        )
        return y
    return keras.ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)


@tf.RegisterGradient("TfgptLayerNorm")
def _layer_norm_gradient(op, dy, unused_dmean, unused_drstd):
    # `mean` and `rstd` are saved statistics for this gradient; `layer_norm`
    # does not return them, so no gradient flows into them.
    x, gamma, _ = op.inputs
    _, mean, rstd = op.outputs
    return kernels.library().tfgpt_layer_norm_grad(dy, x, gamma, mean, rstd)
