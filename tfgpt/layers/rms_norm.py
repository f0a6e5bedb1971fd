"""Root-mean-square layer normalization, computed in float32."""

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfgpt")
class RMSNorm(keras.layers.Layer):
    """Scales vectors to unit root mean square, then by a weight (Zhang & Sennrich 2019).

    `y = gamma * x / sqrt(mean(x^2) + epsilon)` over the last axis, with no
    centring and no bias: Llama's, Mistral's and Qwen2's norm. The
    statistics run in float32 whatever the dtype policy; the normalized
    vector is cast back to the compute dtype before the weight multiplies
    it, as those models do.

    Args:
        epsilon: float. Added to the mean square.
        **kwargs: `keras.layers.Layer`'s (`name`, `dtype`).

    Example:
    >>> layer = RMSNorm(epsilon=1e-6)
    >>> layer(keras.ops.ones((2, 3, 8))).shape
    TensorShape([2, 3, 8])
    """

    def __init__(self, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        self.gamma = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="gamma")
        self.built = True

    def call(self, inputs):
        x = tf.cast(inputs, tf.float32)  # (..., C)
        x = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + self.epsilon)
        return tf.cast(x, self.compute_dtype) * tf.cast(self.gamma, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}
