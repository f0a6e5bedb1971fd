"""A dense layer whose named activation may be fused with its bias add."""

import keras
import tensorflow as tf

from tfgpt import kernels
from tfgpt.config.models import ACTIVATIONS
from tfgpt.parallel.tensor_parallel import current_slice, split_rule

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
        self.adapter_rank = 0  # no adapter (`enable_adapter`)
        # The tensor slice of the block it was built for (an adapter's split follows it).
        self.tensor_slice = current_slice()
        self._replicated_adapter = None

    @property
    def base_kernel(self):
        """The kernel variable itself, which an adapter leaves frozen and merging adds to.

        (`kernel` is what the matmul reads: Keras computes it for a
        quantized layer or under its own `enable_lora`.)
        """
        return self._kernel

    def enable_adapter(self, rank, alpha, dropout=0.0):
        """Adds a low-rank adapter (LoRA, Hu et al. 2021) and freezes the layer's own weights.

        The output becomes `x W + (alpha / rank) dropout(x) A B (+ bias)`:
        `adapter_a` (input width, rank) starts as PEFT's (Kaiming uniform,
        a = sqrt(5)), `adapter_b` (rank, units) at zero, so the layer's output
        is unchanged until B trains. `kernel` and `bias` stop being trainable.
        (Keras's own `enable_lora` folds A B into the kernel at every call,
        whose gradient is then a whole kernel's; here it stays two thin
        products, and dropout applies to the adapter's input.)

        In a layer built in tensor slices the adapter is split as its kernel
        is (`tfgpt.parallel.tensor_parallel.SPLIT_RULES`): a column-parallel
        layer's B by its columns, a row-parallel layer's A by its rows (then
        its dropout draws this slice's own masks); the other matrix is whole
        on every slice, and A starts as the slice of the whole layer's A.
        """
        if not self.built:
            raise ValueError(f"{self.name}: build the layer before adding an adapter")
        if self.adapter_rank:
            raise ValueError(f"{self.name} has an adapter already")
        if rank < 1 or alpha <= 0 or not 0.0 <= dropout < 1.0:
            raise ValueError(
                "An adapter needs rank >= 1, alpha > 0 and dropout in [0, 1). "
                f"Received: rank={rank}, alpha={alpha}, dropout={dropout} ({self.name})")
        tensor_slice = self.tensor_slice
        rules = {name: split_rule(f"{self.name}/{name}") if tensor_slice.size > 1 else None
                 for name in ("adapter_a", "adapter_b")}
        fan_in = self.base_kernel.shape[0]  # this slice's rows
        whole_fan_in = fan_in * (tensor_slice.size if rules["adapter_a"] else 1)
        self._tracker.unlock()
        # PEFT's kaiming_uniform_(a=sqrt(5)): bound = 1 / sqrt(fan_in), of the whole layer.
        bound = 1.0 / whole_fan_in ** 0.5
        initializer = keras.initializers.RandomUniform(-bound, bound)
        if rules["adapter_a"]:
            initializer = tensor_slice.initializer(initializer, (whole_fan_in, rank),
                                                   rules["adapter_a"])
        self.adapter_a = self.add_weight(
            name="adapter_a", shape=(fan_in, rank), dtype=self.variable_dtype,
            initializer=initializer)
        self.adapter_b = self.add_weight(
            name="adapter_b", shape=(rank, self.units), dtype=self.variable_dtype,
            initializer="zeros")
        self.adapter_dropout = keras.layers.Dropout(dropout, dtype=self.dtype_policy,
                                                    name="adapter_dropout")
        self._tracker.lock()
        if rules["adapter_a"] and dropout > 0:  # this slice's part of the input
            tensor_slice.seed_dropout(self.adapter_dropout)
        # The matrix whole beside a split one: its gradient here is this slice's share.
        self._replicated_adapter = ("adapter_a" if rules["adapter_b"] else
                                    "adapter_b" if rules["adapter_a"] else None)
        self.base_kernel.trainable = False
        if self.bias is not None:
            self.bias.trainable = False
        self.adapter_rank, self.adapter_scale = rank, alpha / rank

    def adapter_delta(self):
        """The adapter's `(alpha / rank) A B`, the size of the kernel (what merging adds)."""
        return self.adapter_scale * keras.ops.matmul(self.adapter_a, self.adapter_b)

    def adapter_output(self, inputs, training=None):
        """`(alpha / rank) dropout(inputs) A B`, the adapter's share of the output."""
        x = self.adapter_dropout(inputs, training=training)
        a, b = self.adapter_a, self.adapter_b
        # A split layer: f (identity forward) sums the whole matrix's gradient over the group.
        if self._replicated_adapter == "adapter_a":
            a = self.tensor_slice.copy_to_group(tf.cast(a, x.dtype))
        elif self._replicated_adapter == "adapter_b":
            b = self.tensor_slice.copy_to_group(tf.cast(b, x.dtype))
        x = keras.ops.matmul(keras.ops.matmul(x, a), b)  # (..., r), then (..., units)
        return x * keras.ops.cast(self.adapter_scale, x.dtype)

    def call(self, inputs, training=None):
        x = keras.ops.matmul(inputs, self.kernel)
        if self.adapter_rank:
            x = x + self.adapter_output(inputs, training=training)
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
