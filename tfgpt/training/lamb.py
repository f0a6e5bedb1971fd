"""LAMB: layer-wise adaptive moments (You et al. 2020), as ALBERT trained with it."""

import re

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfgpt")
class LAMB(keras.optimizers.Optimizer):
    """Adam moments with a per-variable trust ratio (You et al. 2020, Algorithm 2).

    For each variable w with gradient g at step t:

        m = beta_1 m + (1 - beta_1) g          v = beta_2 v + (1 - beta_2) g^2
        r = m_hat / (sqrt(v_hat) + epsilon) + weight_decay * w
        w = w - lr * (||w|| / ||r||) * r       (ratio 1 if either norm is 0)

    Unlike `keras.optimizers.Lamb`, which decays weights outside the trust
    ratio (AdamW style), the decay term is inside `r` as in the paper and in
    the implementation ALBERT was pretrained with. Variables whose name
    matches `exclude_pattern` (biases, norms, embeddings by default) get
    neither weight decay nor layer adaptation, as there.

    Args:
        learning_rate: float or schedule.
        beta_1: float. First-moment decay.
        beta_2: float. Second-moment decay.
        epsilon: float. Added to the root of the second moment.
        weight_decay: float. Decay coefficient inside the update.
        exclude_pattern: str. Regular expression over variable names.
        **kwargs: keras.optimizers.Optimizer arguments (global_clipnorm, ...).

    Example:
    >>> optimizer = LAMB(learning_rate=0.00176, weight_decay=0.01)
    """

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-6,
        weight_decay=0.0,
        exclude_pattern=r"(bias|gamma|beta|embeddings)",
        name="lamb",
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.lamb_weight_decay = weight_decay
        self.exclude_pattern = exclude_pattern

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self.add_optimizer_variables(
            var_list, ["momentum", "velocity"]
        )

    def _adapts(self, variable):
        return re.search(self.exclude_pattern, variable.name) is None

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        step = ops.cast(self.iterations + 1, variable.dtype)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign(m, self.beta_1 * m + (1.0 - self.beta_1) * gradient)
        self.assign(v, self.beta_2 * v + (1.0 - self.beta_2) * ops.square(gradient))
        m_hat = m / (1.0 - ops.power(ops.cast(self.beta_1, variable.dtype), step))
        v_hat = v / (1.0 - ops.power(ops.cast(self.beta_2, variable.dtype), step))
        update = m_hat / (ops.sqrt(v_hat) + self.epsilon)
        if self._adapts(variable):
            update = update + self.lamb_weight_decay * variable
            weight_norm = ops.sqrt(ops.sum(ops.square(variable)))
            update_norm = ops.sqrt(ops.sum(ops.square(update)))
            ratio = ops.where(
                ops.logical_and(weight_norm > 0, update_norm > 0),
                weight_norm / ops.maximum(update_norm, 1e-30),
                1.0,
            )
            update = ratio * update
        self.assign_sub(variable, lr * update)

    def get_config(self):
        config = super().get_config()
        config.update(
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            epsilon=self.epsilon,
            weight_decay=self.lamb_weight_decay,
            exclude_pattern=self.exclude_pattern,
        )
        return config
