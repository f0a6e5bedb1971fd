"""Base of tfgpt's layers: get_config() from the recorded constructor arguments."""

import keras

from tfgpt.layers.activated_dense import ActivatedDense
from tfgpt.layers.layer_norm import LayerNorm


def normal_initializer():
    """The models' weight initializer: normal, standard deviation 0.02 (GPT-2, BERT).

    (An unseeded Keras initializer draws its seed when it is created, so
    layers that share one start from the same random stream.)
    """
    return keras.initializers.RandomNormal(stddev=0.02)


class ConfiguredLayer(keras.layers.Layer):
    """A layer whose `get_config()` is Keras's plus the arguments it records.

    A subclass calls `self.record_config(name=value, ...)` once in its
    constructor, with its constructor arguments: each becomes an attribute of
    its own name, and `get_config()` returns them under that name, so
    `from_config` and `.keras` files rebuild the layer through the same
    constructor (the layers' counterpart of `ConfiguredModel`). Sublayers
    made by `_dense`, `_embedding`, `_layer_norm` and `_dropout` take the
    layer's dtype policy; dense kernels and embedding tables start from
    `normal_initializer()` unless given an initializer.

    Example:
    >>> class Scale(ConfiguredLayer):
    ...     def __init__(self, factor=2.0, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.record_config(factor=factor)
    ...     def call(self, inputs):
    ...         return inputs * self.factor
    >>> Scale(3.0).get_config()["factor"]
    3.0
    """

    # The names `record_config` was given, in order.
    _config_names = ()

    def record_config(self, **arguments):
        for name, value in arguments.items():
            setattr(self, name, value)
        self._config_names = tuple(arguments)

    def get_config(self):
        config = super().get_config()
        config.update({name: getattr(self, name) for name in self._config_names})
        return config

    def _dense(self, units, name, initializer=None, dense_class=ActivatedDense, **kwargs):
        """A `dense_class` projection; with `initializer=None` one of its own."""
        return dense_class(
            units,
            kernel_initializer=initializer or normal_initializer(),
            dtype=self.dtype_policy,
            name=name,
            **kwargs,
        )

    def _embedding(self, rows, width, name, initializer=None):
        """A (rows, width) embedding table; with `initializer=None` one of its own."""
        return keras.layers.Embedding(
            rows,
            width,
            embeddings_initializer=initializer or normal_initializer(),
            dtype=self.dtype_policy,
            name=name,
        )

    def _layer_norm(self, epsilon, name):
        return LayerNorm(epsilon=epsilon, dtype=self.dtype_policy, name=name)

    def _dropout(self, rate, name):
        return keras.layers.Dropout(rate, dtype=self.dtype_policy, name=name)
