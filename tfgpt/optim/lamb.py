"""LAMB: layer-wise adaptive moments (You et al. 2020), as ALBERT trained with it."""

import contextlib
import re

import keras
import tensorflow as tf
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

    Sharded (ZeRO, `tfgpt.parallel.zero`), each rank holds some rows of
    every variable: the trust ratio still needs the norms of the whole
    weight and the whole update. `norm_sum`, when set, sums a vector over
    the ranks: the update then computes every variable's partial sums of
    squares first, sums them all in one call, and applies the ratios after.
    `given_gradient_norm(norm)` hands `global_clipnorm` the norm of the
    whole gradients (the caller's all-reduced one) instead of the norm of
    the rows this rank received.

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
        self.norm_sum = None
        self._given_norm = None

    @contextlib.contextmanager
    def given_gradient_norm(self, norm):
        """Uses `norm` as the global norm of the gradients `apply` receives (clipping)."""
        previous, self._given_norm = self._given_norm, norm
        try:
            yield
        finally:
            self._given_norm = previous

    def _clip_gradients(self, grads):
        given, self._given_norm = self._given_norm, None
        if given is None or not self.global_clipnorm or self.clipnorm:
            return super()._clip_gradients(grads)
        norm = tf.cast(given, "float32")
        # As keras.optimizers' clip_by_global_norm: NaN for a non-finite norm.
        scale = self.global_clipnorm * tf.minimum(1.0 / norm, 1.0 / self.global_clipnorm) + (
            norm - norm
        )
        return [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self.add_optimizer_variables(
            var_list, ["momentum", "velocity"]
        )

    def _adapts(self, variable):
        return re.search(self.exclude_pattern, variable.name) is None

    def _moments_and_update(self, gradient, variable):
        """Updates the moments; returns the step direction r before the ratio."""
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
        return update

    @staticmethod
    def _ratio(weight_norm, update_norm):
        return ops.where(
            ops.logical_and(weight_norm > 0, update_norm > 0),
            weight_norm / ops.maximum(update_norm, 1e-30),
            1.0,
        )

    def update_step(self, gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        update = self._moments_and_update(gradient, variable)
        if self._adapts(variable):
            weight_norm = ops.sqrt(ops.sum(ops.square(variable)))
            update_norm = ops.sqrt(ops.sum(ops.square(update)))
            update = self._ratio(weight_norm, update_norm) * update
        self.assign_sub(variable, lr * update)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if self.norm_sum is None:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        # Sharded: every variable's partial squared norms, summed over the
        # ranks in one call, then the ratios.
        variables = [v.value if isinstance(v, keras.Variable) else v for v in trainable_variables]
        updates = [self._moments_and_update(g, v) for g, v in zip(grads, variables)]
        adapted = [index for index, v in enumerate(variables) if self._adapts(v)]
        if adapted:
            partial = ops.stack(
                [ops.sum(ops.square(ops.cast(variables[i], "float32"))) for i in adapted]
                + [ops.sum(ops.square(ops.cast(updates[i], "float32"))) for i in adapted]
            )
            norms = ops.sqrt(self.norm_sum(partial))
            for position, index in enumerate(adapted):
                ratio = self._ratio(norms[position], norms[len(adapted) + position])
                updates[index] = ops.cast(ratio, updates[index].dtype) * updates[index]
        for variable, update in zip(variables, updates):
            self.assign_sub(variable, ops.cast(learning_rate, variable.dtype) * update)

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
