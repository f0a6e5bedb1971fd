"""A dense layer whose named activation may be fused with its bias add."""

import keras

from tfgpt import kernels
from tfgpt.config.models import ACTIVATIONS

_GELU_APPROXIMATE = {"gelu": False, "gelu_tanh": True}


@keras.saving.register_keras_serializable(package="tfgpt")
class ActivatedDense(keras.layers.Dense):
    """`keras.layers.Dense` with an activation given by name, GELU fused.

    Same variables (`kernel`, `bias`), names and results as
    `keras.layers.Dense(units, activation=...)`, so checkpoints and
    converters see no difference. With a GELU activation the bias add, the
    GELU and (in the backward pass) the bias gradient run as one kernel
    (`tfgpt.kernels.bias_gelu`) instead of a BiasAdd, about eight
    elementwise ops and a BiasAddGrad reduction: the feed-forward layer's
    (B, T, 4C) output is read once forward and once backward.

    Args:
        units: int. Output width.
        activation: str or None. `"gelu"` (exact, erf), `"gelu_tanh"` (tanh
            approximation, GPT-2's `gelu_new`), `"relu"`, `"silu"` (x *
            sigmoid(x), Llama's gate) or None.
        **kwargs: the other arguments of `keras.layers.Dense`.

    Example:
    >>> layer = ActivatedDense(8, activation="gelu_tanh")
    >>> layer(keras.ops.ones((2, 3, 4))).shape
    TensorShape([2, 3, 8])
    """

    def __init__(self, units, activation=None, **kwargs):
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(
                f"`activation` must be one of {ACTIVATIONS} or None. "
                f"Received: activation={activation!r}"
            )
        super().__init__(units, activation=None, **kwargs)
        self.activation_name = activation

    def call(self, inputs, training=None):
        x = keras.ops.matmul(inputs, self.kernel)
        if self.activation_name in _GELU_APPROXIMATE and self.bias is not None:
            return kernels.bias_gelu(
                x, self.bias, approximate=_GELU_APPROXIMATE[self.activation_name]
            )
        if self.bias is not None:
            x = keras.ops.add(x, self.bias)
        return self._activate(x)

    def quantized_call(self, *args, **kwargs):
        # Keras' quantized matmuls apply `self.activation`, None here.
        return self._activate(super().quantized_call(*args, **kwargs))

    def _activate(self, x):
        if self.activation_name in _GELU_APPROXIMATE:
            return kernels.gelu(x, approximate=_GELU_APPROXIMATE[self.activation_name])
        if self.activation_name == "relu":
            return keras.activations.relu(x)
        if self.activation_name == "silu":
            return keras.activations.silu(x)
        return x

    def get_config(self):
        config = super().get_config()
        config["activation"] = self.activation_name
        return config
