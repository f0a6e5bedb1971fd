"""AdamW whose per-variable Adam step is TensorFlow's fused `ApplyAdam` kernel."""

import contextlib

import keras
import tensorflow as tf
from keras.src.optimizers.base_optimizer import global_norm
from keras.src.utils.naming import auto_name

from tfgpt import kernels

# The dtype whose numerics are checked against Keras (tests/test_fused_adamw.py).
# Keras rounds some constants through float32 for other dtypes (float64
# moments then differ from the kernel's at 1e-8), so those keep its ops.
_FUSED_DTYPES = (tf.float32,)


@keras.saving.register_keras_serializable(package="tfgpt")
class FusedAdamW(keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` with each variable's Adam step in one kernel.

    Keras computes the Adam step of a variable as a chain of element-wise
    ops (square, subtract, multiply, sqrt, divide, three assignments), each
    a separate pass over memory. `tf.raw_ops.ResourceApplyAdam` does the
    same arithmetic in one multi-threaded pass over the variable, both
    moments and the gradient (and has an XLA kernel, so it also runs inside
    `jit_compile=True`):

        alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)
        m += (g - m) * (1 - beta_1)         v += (g^2 - v) * (1 - beta_2)
        w -= (m * alpha) / (sqrt(v) + epsilon)

    which is `keras.optimizers.Adam.update_step` operation for operation,
    with one difference in rounding: the kernel forms `1 - beta` in the
    variable's dtype from `beta` in that dtype, whereas Keras rounds the
    Python double `1 - beta` to it. For beta_1 = 0.9 that is 0.10000002
    instead of 0.1 in float32 (beta_2 = 0.95: 0.05000001 instead of 0.05),
    so moments and weights differ from Keras's in the last bits (about
    1e-7 relative); no float32 `beta` reproduces Keras's constant exactly.

    The decoupled weight decay, `w -= w * weight_decay * lr` before the Adam
    step on every variable not excluded by `exclude_from_weight_decay`, is
    one `ResourceApplyGradientDescent` with `alpha = weight_decay * lr` and
    `delta = w`: in a `tf.function` this is bit for bit what Keras's
    `w * weight_decay * lr` becomes, since TensorFlow's graph optimizer
    (and XLA) first multiplies the two scalars, but one pass over `w`
    instead of two. (Run eagerly, Keras rounds `w * weight_decay` first.)

    Where tfgpt's fused CPU kernels are in use (`tfgpt.kernels`: built,
    no GPU, not under XLA) and no `tf.distribute` strategy is active (one
    process, or Horovod), the whole update of a float32 variable is one
    `TfgptResourceApplyAdamW` kernel instead: the weight decay, the
    `global_clipnorm` scaling of the gradient and the Adam step above in one
    pass over the variable, its moments and its gradient, in the same order
    and float32 arithmetic (so the weights match the two TensorFlow kernels'
    to float32 round-off, not bit for bit: the C++ compiler may fuse a
    multiply and an add). The global norm is computed once per step; a
    caller that has already computed it (TrainStep reports it) passes it in
    `with optimizer.given_gradient_norm(norm):` around `apply`.

    Everything else is `keras.optimizers.AdamW`'s own code: clipping,
    loss-scale factor, gradient accumulation, EMA, the `tf.distribute`
    update path (`merge_call`, then `strategy.extended.update` per replica,
    where the slots resolve to that replica's copy), the slot variables and
    their names (and the optimizer's default name, `adam_w`), so
    checkpoints move freely between the two classes.

    The parent's element-wise step is kept, deliberately, for `amsgrad=True`
    (its extra slot is not what the kernel expects), for variables other
    than float32 (tfgpt's are float32, under mixed precision too), and for
    `tf.IndexedSlices` gradients:
    Keras's arithmetic on slices squares them before summing repeated rows,
    which the dense kernel would not reproduce. (TrainStep and the Horovod
    wrapper hand the optimizer dense gradients; plain `model.fit` may not.)

    On gpt-mini with 2 CPU threads this makes a training step 1-3% faster
    in float32 and 7-8% in mixed bfloat16 (the optimizer update alone about
    half as long).

    Args:
        Those of `keras.optimizers.AdamW`.

    Example:
    >>> optimizer = FusedAdamW(learning_rate=3e-4, weight_decay=0.1,
    ...                        beta_1=0.9, beta_2=0.95, epsilon=1e-8)
    >>> optimizer.exclude_from_weight_decay(var_names=["bias"])

    Papers: Kingma & Ba 2015 (Adam); Loshchilov & Hutter 2019 (AdamW).
    """

    def __init__(self, *args, name=None, **kwargs):
        # Named as keras.optimizers.AdamW names itself (`adam_w`, `adam_w_1`,
        # ...), so its variables' paths and the ops' name scopes are the same.
        super().__init__(*args, name=name or auto_name("AdamW"), **kwargs)
        # Trace-time state of one `apply`: whether it takes the one-pass
        # kernel, and the gradient scale (global-norm clip) it folds in.
        self._fused_apply = False
        self._gradient_scale = None
        self._given_norm = None

    @contextlib.contextmanager
    def given_gradient_norm(self, norm):
        """Uses `norm` as the global norm of the gradients `apply` receives.

        For `global_clipnorm`: the caller computed the norm already, so the
        clipping does not compute it again. `norm` must be the global norm
        of exactly the (unscaled) gradients passed to `apply`.
        """
        previous, self._given_norm = self._given_norm, norm
        try:
            yield
        finally:
            self._given_norm = previous

    def _backend_apply_gradients(self, grads, trainable_variables):
        self._fused_apply = kernels.dispatch.runs("adamw", strategy=tf.distribute.has_strategy())
        try:
            super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            self._fused_apply, self._gradient_scale = False, None

    def _clip_gradients(self, grads):
        given, self._given_norm = self._given_norm, None
        if self.gradient_accumulation_steps:
            given = None  # Keras clips the accumulated mean, not what `apply` got
        clip = self.global_clipnorm
        if self.clipnorm or not clip or clip <= 0 or (given is None and not self._fused_apply):
            return super()._clip_gradients(grads)
        norm = global_norm(grads) if given is None else tf.cast(given, tf.float32)
        # As keras.optimizers' clip_by_global_norm: NaN for a non-finite norm.
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        if self._fused_apply:
            self._gradient_scale = scale
            return grads
        return [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]

    def _fused(self, gradient, target):
        return (self._fused_apply and not self.amsgrad and tf.as_dtype(target.dtype) == tf.float32
                and not isinstance(gradient, tf.IndexedSlices))

    def _apply_weight_decay(self, variables):
        # keras/src/backend/tensorflow/optimizer.py's version, with the
        # decay of each variable in one kernel.
        if self.weight_decay is None or self._fused_apply:
            return  # the fused apply decays in update_step

        def decay(variable, learning_rate):
            # On the tf.Variable (a replica's copy), as Keras checks it.
            if not self._use_weight_decay(variable):
                return
            dtype = tf.as_dtype(variable.dtype)
            lr = tf.cast(learning_rate, dtype)
            wd = tf.cast(self.weight_decay, dtype)
            if dtype not in _FUSED_DTYPES:
                variable.assign_sub(variable * wd * lr)
                return
            tf.raw_ops.ResourceApplyGradientDescent(
                var=variable.handle, alpha=wd * lr, delta=variable, use_locking=False
            )

        def decay_on_each_replica(distribution, variables):
            # The schedule once, not once per variable as Keras evaluates it.
            learning_rate = self.learning_rate
            for variable in variables:
                if isinstance(variable, keras.Variable):
                    variable = variable.value
                distribution.extended.update(
                    variable, decay, args=(learning_rate,), group=False
                )

        tf.__internal__.distribute.interim.maybe_merge_call(
            decay_on_each_replica, self._distribution_strategy, variables
        )

    def update_step(self, gradient, variable, learning_rate):
        # Under tf.distribute (and with the TF backend generally) `variable`
        # is already the tf.Variable (a replica's copy); otherwise unwrap.
        target = variable.value if isinstance(variable, keras.Variable) else variable
        dtype = tf.as_dtype(target.dtype)
        if self._fused_apply:
            return self._fused_update_step(gradient, variable, target, learning_rate)
        if self.amsgrad or dtype not in _FUSED_DTYPES or isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        # Scalars exactly as keras.optimizers.Adam.update_step forms them.
        local_step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.cast(self.beta_1, dtype)
        beta_2 = tf.cast(self.beta_2, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=target.handle,
            # Inside strategy.extended.update, `.handle` of a mirrored slot
            # is the copy on the replica being updated.
            m=self._momentums[index].value.handle,
            v=self._velocities[index].value.handle,
            beta1_power=tf.pow(beta_1, local_step),
            beta2_power=tf.pow(beta_2, local_step),
            lr=tf.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=tf.cast(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype),
            use_locking=False,
            use_nesterov=False,
        )

    def _fused_update_step(self, gradient, variable, target, learning_rate):
        decays = self.weight_decay is not None and self._use_weight_decay(target)
        if not self._fused(gradient, target):
            # Keras's own step, after the decay and clip scale it would
            # have applied before it.
            dtype = target.dtype
            if decays:
                target.assign_sub(target * tf.cast(self.weight_decay, dtype)
                                  * tf.cast(learning_rate, dtype))
            if self._gradient_scale is not None:
                scale = tf.cast(self._gradient_scale, gradient.dtype)
                gradient = (tf.IndexedSlices(gradient.values * scale, gradient.indices,
                                             gradient.dense_shape)
                            if isinstance(gradient, tf.IndexedSlices) else gradient * scale)
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        local_step = tf.cast(self.iterations + 1, tf.float32)
        beta_1 = tf.cast(self.beta_1, tf.float32)
        beta_2 = tf.cast(self.beta_2, tf.float32)
        learning_rate = tf.cast(learning_rate, tf.float32)
        decay = (tf.cast(self.weight_decay, tf.float32) * learning_rate if decays
                 else tf.constant(0.0))
        scale = (tf.constant(1.0) if self._gradient_scale is None
                 else tf.cast(self._gradient_scale, tf.float32))
        kernels.library().tfgpt_resource_apply_adam_w(
            var=target.handle,
            m=self._momentums[index].value.handle,
            v=self._velocities[index].value.handle,
            grad=tf.cast(gradient, tf.float32),
            lr=learning_rate,
            beta1=beta_1,
            beta2=beta_2,
            epsilon=tf.cast(self.epsilon, tf.float32),
            beta1_power=tf.pow(beta_1, local_step),
            beta2_power=tf.pow(beta_2, local_step),
            decay=decay,
            grad_scale=scale,
        )
