"""Optimizer construction from a run config (`TrainConfig`, `FinetuneConfig`)."""

import keras

from tfgpt.optim.fused_adamw import FusedAdamW
from tfgpt.optim.lamb import LAMB
from tfgpt.optim.schedules import WarmupDecay

# Weight decay regularises matrices; decaying norms, biases and embeddings
# hurts (Loshchilov & Hutter 2019; GPT-2 and nanoGPT exclude them too).
NO_DECAY_PATTERN = r"(bias|gamma|beta|embeddings)"


def learning_rate_schedule(config, num_workers=1, steps=None):
    """Warmup and decay over `steps` (default `config.steps`) steps."""
    steps = steps or config.steps
    peak = config.learning_rate * (num_workers if config.scale_learning_rate else 1)
    return WarmupDecay(
        peak,
        warmup_steps=min(config.warmup_steps_of(steps), steps),
        total_steps=steps,
        decay=config.schedule,
        final_ratio=config.final_learning_rate_ratio,
    )


def set_worker_count(optimizer, config, num_workers, steps=None):
    """Gives `optimizer` the schedule of `num_workers` workers and returns
    it (an elastic run's world size changed). Steps traced with the old
    schedule must be traced again."""
    schedule = learning_rate_schedule(config, num_workers, steps)
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # under float16's loss scaling
    inner.learning_rate = schedule
    return schedule


def make_optimizer(config, num_workers=1, steps=None):
    """Returns the optimizer for `config`, wrapped for loss scaling under float16.

    Args:
        config: a `tfgpt.config.training.RunConfig` (TrainConfig, FinetuneConfig).
        num_workers: int. Data-parallel workers, for learning-rate scaling.
        steps: int. Steps of the run, when they are not `config.steps`
            (fine-tuning derives them from the data).
    """
    common = dict(
        learning_rate=learning_rate_schedule(config, num_workers, steps),
        weight_decay=config.weight_decay,
        global_clipnorm=config.gradient_clip_norm or None,
    )
    if config.optimizer == "lamb":
        # LAMB's own defaults (You et al. 2020, as in the ALBERT recipe).
        optimizer = LAMB(beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                         exclude_pattern=NO_DECAY_PATTERN, **common)
    else:
        # GPT-3's AdamW settings (Brown et al. 2020, appendix B). Keras's
        # AdamW with each variable's update in one fused kernel.
        optimizer = FusedAdamW(beta_1=0.9, beta_2=0.95, epsilon=1e-8, **common)
        optimizer.exclude_from_weight_decay(var_names=[NO_DECAY_PATTERN])
    if config.mixed_precision == "float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
