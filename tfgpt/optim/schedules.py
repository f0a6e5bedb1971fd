"""Learning-rate schedule: linear warmup, then cosine, linear or no decay."""

import math

import keras
import tensorflow as tf

from tfgpt.config.checks import require_one_of
from tfgpt.config.training import SCHEDULES


@keras.saving.register_keras_serializable(package="tfgpt")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak`, then decay to `peak * final_ratio` at `total_steps`.

    Args:
        peak: float. Learning rate at the end of warmup.
        warmup_steps: int. Steps of linear warmup (0 starts at the peak).
        total_steps: int. Step at which the decay reaches its floor.
        decay: str. `"cosine"`, `"linear"` or `"constant"`.
        final_ratio: float. Floor as a fraction of the peak.

    Example:
    >>> schedule = WarmupDecay(1e-3, warmup_steps=10, total_steps=100)
    >>> float(schedule(5))
    0.0005
    """

    def __init__(self, peak, warmup_steps, total_steps, decay="cosine", final_ratio=0.1):
        require_one_of("decay", decay, SCHEDULES)
        if warmup_steps > total_steps:
            raise ValueError(
                "`warmup_steps` must not exceed `total_steps`. "
                f"Received: warmup_steps={warmup_steps}, total_steps={total_steps}"
            )
        self.peak = peak
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.decay = decay
        self.final_ratio = final_ratio

    def __call__(self, step):
        step = tf.cast(step, "float32")
        peak = tf.constant(self.peak, "float32")
        # Step 0 already gets a non-zero rate: (step + 1) / warmup.
        warmup = peak * tf.minimum(1.0, (step + 1.0) / max(self.warmup_steps, 1))
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = tf.clip_by_value((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        if self.decay == "cosine":
            shape = 0.5 * (1.0 + tf.cos(math.pi * progress))
        elif self.decay == "linear":
            shape = 1.0 - progress
        else:
            shape = tf.constant(1.0)
        floor = self.final_ratio
        decayed = peak * (floor + (1.0 - floor) * shape)
        return tf.where(step < self.warmup_steps, warmup, decayed)

    def get_config(self):
        return dict(
            peak=self.peak,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            decay=self.decay,
            final_ratio=self.final_ratio,
        )
