"""Keras's LayerNormalization, run by tfgpt's fused kernel where it applies."""

import keras

from tfgpt.kernels.layer_norm_kernel import layer_norm

_KERAS_NAME = "layer_normalization"


@keras.saving.register_keras_serializable(package="tfgpt")
class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` with a fused CPU kernel (Ba et al. 2016).

    Same arguments, variables (`gamma`, `beta`), variable paths, default
    name and `get_config()` as Keras's layer, so checkpoints, saved
    `.keras` files and the Hugging Face converters see no difference. In the
    configuration the models use (last axis, `center` and `scale`, no
    `rms_scaling`) `call` goes through `tfgpt.kernels.layer_norm`: one
    float32 pass forward and one backward on CPU instead of a dozen ops
    (and their bfloat16 <-> float32 casts under mixed precision); under XLA,
    with the kernels disabled or unbuilt it runs Keras's ops unchanged. Other
    configurations run Keras's `call`.

    Args:
        axis: int or list of ints. Axes to normalize over (default: last).
        epsilon: float. Added to the variance.
        **kwargs: every other `keras.layers.LayerNormalization` argument.

    Example:
    >>> layer = LayerNorm(epsilon=1e-5)
    >>> layer(keras.ops.ones((2, 3, 8))).shape
    TensorShape([2, 3, 8])
    """

    def __init__(self, axis=-1, epsilon=1e-3, **kwargs):
        if kwargs.get("name") is None:
            # Keras's own default name ("layer_normalization", "..._1", ...),
            # from the same counter, not one derived from this class's name.
            uid = keras.backend.get_uid(_KERAS_NAME)
            kwargs["name"] = _KERAS_NAME if uid == 1 else f"{_KERAS_NAME}_{uid - 1}"
        super().__init__(axis=axis, epsilon=epsilon, **kwargs)

    def _is_fusable(self, inputs):
        """True in the configuration the fused kernel computes."""
        rank = inputs.shape.rank
        if not rank or not (self.center and self.scale) or self.rms_scaling:
            return False
        axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        return len(axes) == 1 and axes[0] % rank == rank - 1

    def call(self, inputs):
        if not self._is_fusable(inputs):
            return super().call(inputs)
        outputs = layer_norm(inputs, self.gamma, self.beta, self.epsilon)
        return keras.ops.cast(outputs, self.compute_dtype)
