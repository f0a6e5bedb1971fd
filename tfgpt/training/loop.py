"""The run core every kind of run shares: model and optimizer, checkpoints, the loop.

`tfgpt.training.trainer.train` (pretraining) and
`tfgpt.finetuning.finetuner.finetune` read their data and build their
models their own way; both then go through these, in order:
`existing_checkpoints` (refuse to overwrite a run), `start_up_warnings`,
`build_model_and_optimizer` (the rank's `RunPart`: its step, checkpointer
and start-up broadcast), `run_record` (what config.json records), and
`run_loop`: the steps, windowed logging with tokens/s and MFU, the
profiler, checkpoints with the divergence check, and the final save.
"""

import dataclasses
import math
import os
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from tfgpt import kernels
from tfgpt.checkpoint import latest
from tfgpt.checkpoint import run as checkpoint_run
from tfgpt.checkpoint.base import AdapterBase, read_base, whole_model_checkpoint
from tfgpt.checkpoint.state import model_entries, run_entries
from tfgpt.cli import byte_size
from tfgpt.models.adapters import adapter_variables, base_keys
from tfgpt.models.gpt import GPT
from tfgpt.observe import flops, monitor
from tfgpt.observe.profiling import StepProfiler
from tfgpt.optim.optimizers import make_optimizer
from tfgpt.optim.precision import slow_precision_warning
from tfgpt.parallel.zero import idle_sharding_warning, shard_state, state_bytes
from tfgpt.training.train_step import STEP_TIMES, EvalStep, TrainStep

POLICIES = {"off": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


class StoppedEarly(Exception):
    """A callback stopped the run after a step; its checkpoint is saved.

    Attributes: `reason` (the callback's words), `step`, `path` (the checkpoint).
    """

    def __init__(self, reason, step, path):
        # Only the chief has the committed checkpoint's path (`path` is None elsewhere).
        saved = path or "this rank's part of the checkpoint"
        super().__init__(f"{reason}: stopped after step {step}, saved {saved}")
        self.reason, self.step, self.path = reason, step, path


class Callback:
    """What a run does around its steps beside the loop's own work (`run_loop`).

    The loop calls every callback's `on_step_begin(step)` before step
    `step` reads its batch, `on_step_end(step)` once it is done (before its
    logging and saving), `should_stop(step)` after its logging and saving
    (on every rank in the same order: it may run a collective), and
    `on_save(step)` once a checkpoint is committed. An elastic run's data
    position and commits, a global order's cursor, preemption
    (`tfgpt.resilience.preemption`) and the test-only fault injection
    (`tfgpt.resilience.faults`) are callbacks.
    """

    def on_step_begin(self, step):
        pass

    def on_step_end(self, step):
        pass

    def on_save(self, step):
        pass

    def should_stop(self, step):
        """None to go on; else the reason to save step `step` and stop
        (the same on every rank): `run_loop` raises `StoppedEarly`."""
        del step

    def compute_delay(self):
        """Seconds each forward pass starts late, inside the measured compute
        (the train step takes the sum; only fault injection sets it)."""
        return 0.0


def compute_delay(callbacks):
    """The seconds the callbacks delay each forward pass by, for `TrainStep(compute_delay=)`."""
    return sum(callback.compute_delay() for callback in callbacks)


class EachStep(Callback):
    """Calls `function(step)` at the end of every step."""

    def __init__(self, function):
        self.function = function

    def on_step_end(self, step):
        self.function(step)


def existing_checkpoints(config):
    """Whether `config.out` holds checkpoints; raises unless `config.resume`,
    and when this process cannot write there: refused before training, not
    at the first save."""
    check_writable(config.out)
    found = latest(config.out) is not None
    if found and not config.resume:
        raise ValueError(
            f"--out {config.out} already holds checkpoints: pass --resume to continue "
            "that run, or choose another --out"
        )
    return found


def check_writable(out):
    """Raises ValueError unless this process can write in the directory `out`,
    or, while it does not exist, in its nearest existing parent (where it
    would be made): a probe file written and removed."""
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--out {out} cannot be written: {existing} is not a directory")
    probe = os.path.join(existing, f".tfgpt-write-test-{os.getpid()}")
    try:
        with open(probe, "wb") as file:
            file.write(b"\0")
        os.remove(probe)
    except OSError as error:
        raise ValueError(f"--out {out} cannot be written: {error}") from None


def towers_of(config, distribution):
    """An explicit --towers wins; 0 takes what the distribution split its threads for."""
    return config.towers or distribution.towers


def release_in_background(*objects):
    """Drops the last references to `objects` on a daemon thread; returns at once.

    For the training input: destroying a tf.data iterator cancels its
    prefetch threads and waits for them, which took 6 to 30 s after the
    last step of a `horovodrun -np 2` run on a busy 2-core machine (the
    validation line printed, the process still there). Released this way,
    the teardown overlaps the evaluation, and a front end leaving with
    `os._exit` (`tfgpt.training.front_end.exit_after_run`) does not wait for it.
    The caller must hold no other reference.
    """
    held = list(objects)
    del objects
    threading.Thread(target=held.clear, name="tfgpt-release-input", daemon=True).start()


def kernel_summary(config, distribution, model):
    """The start-up line naming the fused CPU kernels this run's steps use, and why not the
    others."""
    backbone = getattr(model, "backbone", model)  # fine-tuning: a head on a backbone
    reasons = None
    if isinstance(backbone, GPT):
        reasons = decoder_kernel_reasons(backbone.config)
    return kernels.summary(
        "float32" if config.mixed_precision == "off" else config.mixed_precision,
        xla=config.xla,
        dropout=backbone.config.dropout,
        masked=not isinstance(backbone, GPT),  # encoders pass a padding mask
        strategy=hasattr(distribution, "strategy"),
        tensor_parallel=distribution.state.tensor > 1,
        model_reasons=reasons,
    )


def decoder_kernel_reasons(config):
    """`{kernel: why it does not run}` for the switches of a decoder's `GPTConfig`."""
    reasons = {}
    unfused = [why for why, on in (
        ("rotary positions", config.positions == "rotary"),
        ("grouped-query attention", config.key_value_heads != config.num_heads),
        ("a sliding window", config.sliding_window > 0),
        ("unscaled scores", not config.scale_attention)) if on]
    if unfused:
        reasons["attention"] = f"{', '.join(unfused)}: plain ops"
    if config.sliding_window:
        reasons["softmax"] = "the sliding window's mask: plain ops"
    if config.norm == "rms":
        reasons["layer_norm"] = "RMSNorm runs plain ops (no fused kernel yet)"
    if config.activation not in ("gelu", "gelu_tanh") or not config.feedforward_bias:
        reasons["bias_gelu"] = (f"{config.activation} "
                                f"{'without a bias' if not config.feedforward_bias else ''}"
                                ).strip() + ": plain ops"
    return reasons


def warmup_warning(config, steps):
    """A warning (str) when the warmup lasts the whole run of `steps` steps, else None."""
    warmup = config.warmup_steps_of(steps)
    if warmup < steps:
        return None
    return (
        f"{config.WARMUP_FLAG} gives {warmup} warmup steps for a run of {steps}: the "
        "learning rate climbs for the whole run, reaches its peak only at the last step "
        f"and never decays ({config.schedule}); raise --steps or shorten the warmup"
    )


def start_up_warnings(report, config, steps, distribution):
    """Logs (chief only) what would make this run slow or not what was meant."""
    for warning in (slow_precision_warning(config.mixed_precision), warmup_warning(config, steps),
                    idle_sharding_warning(distribution)):
        if warning:
            report.info(f"warning: {warning}")


def build_model_and_optimizer(config, distribution, build_model, steps, part=None,
                              sequence_length=None):
    """The run's `RunPart` (of class `part`; a pipeline's stages exchange
    sequences of `sequence_length` tokens): identical initial weights on
    every worker (seeded).

    `build_model()` runs in the distribution's scope, under the precision
    policy; the optimizer's slots exist before the first step, so that
    rank 0's state can be broadcast (`RunPart.broadcast`).
    """
    part = part or RunPart
    keras.utils.set_random_seed(config.seed)
    keras.config.set_dtype_policy(POLICIES[config.mixed_precision])
    with distribution.scope():
        model = part.build_model(build_model)
        optimizer = distribution.configure_optimizer(
            make_optimizer(config, distribution.size, steps=steps)
        )
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        return part(model, optimizer, step, distribution, sequence_length=sequence_length)


class RunPart:
    """What this rank builds, trains, broadcasts and checkpoints: the whole
    model (of its tensor slice), under the run's sharding.

    A layout whose ranks train parts of the model subclasses it
    (`tfgpt.training.pipeline_run.PipelinePart`); the run core asks its
    part and never which layout runs.

    Attributes:
        model: keras.Model, whole (of this rank's tensor slice).
        optimizer: built on what this rank updates.
        step: int64 tf.Variable, the steps done.
        distribution: the run's distribution.
        sharding: `tfgpt.parallel.zero.ZeroSharding` at `--zero-stage` 1-3,
            else `Unsharded`: what this rank holds of the trained state.
        stage: None here; a pipeline rank's `PipelineStage`.
    """

    stage = None
    base = None

    @staticmethod
    def check(config, options, model_config):
        """Raises ValueError for sizes this layout cannot cut (the whole model: none)."""

    @staticmethod
    def build_model(build_model):
        return build_model()

    def __init__(self, model, optimizer, step, distribution, sequence_length=None):
        self.model, self.optimizer, self.step = model, optimizer, step
        self.distribution = distribution
        self.sharding = shard_state(model, optimizer, distribution,
                                    self.trained.trainable_variables)
        # An adapter run's frozen base: its checkpoints name it instead of holding it.
        if adapter_variables(model):
            base = base_keys(model)
            self.base = AdapterBase(lambda: self._entries(only=base), base)

    @property
    def trained(self):
        """What this rank trains: the model (a pipeline's: its stage)."""
        return self.model

    def train_step(self, **options):
        """The step (`TrainStep` with `options`)."""
        return TrainStep(self.model, self.optimizer, self.distribution, zero=self.sharding,
                         **options)

    def eval_step(self, loss_fn, xla=False):
        """`(loss, metrics)` of a batch without training."""
        return EvalStep(self.model, loss_fn=loss_fn, xla=xla, zero=self.sharding)

    def describe(self):
        """The start-up lines of what this rank holds."""
        return [state_line(self.trained, self.distribution, self.sharding)]

    def broadcast(self):
        """Makes rank 0's state its data group's: what every rank of it holds alike."""
        self.distribution.broadcast_variables(self.sharding.broadcast_set() + [self.step])

    def _entries(self, counters=(), only=None):
        """This rank's parts of the run's state (`only`: of these keys); an
        adapter run whose base is loaded leaves the base weights out."""
        coordinates, _ = checkpoint_run.layout_of(self.distribution)
        entries = run_entries(self.model, self.optimizer, coordinates, self.sharding,
                              tensor_slice=self.distribution.tensor_slice, stage=self.stage,
                              counters=counters)
        if only is not None:
            return [entry for entry in entries if entry.key in only and not entry.per_rank]
        if self.base is not None and self.base.reference is not None:
            base = base_keys(self.model)
            entries = [entry for entry in entries if entry.key not in base]
        return entries

    def initialize_from(self, directory):
        """Reads the model's weights that this rank holds (not the optimizer's
        state, nor the step) from the latest checkpoint of the run `directory`,
        whatever layout wrote it, or from the transformers decoder directory
        `directory`; returns its path (`--init`). Under adapters
        that checkpoint becomes the base its checkpoints name."""
        if self.base is not None:  # (adapters added for this run keep their start)
            path = self.base.initialize_from(directory)
        else:
            path = whole_model_checkpoint(directory)
            weights = {entry.key for entry in model_entries(self.model)}
            read_base(path, [entry for entry in self._entries()
                             if entry.key in weights and not entry.per_rank])
        self.sharding.after_restore()
        return path

    def checkpointer(self, config, data_cursor=None):
        """The run's `tfgpt.checkpoint.RunCheckpointer` in `config.out`.

        Every rank writes its part of the model, the optimizer (its moments
        sliced and sharded as its variables are), the step and its dropout
        state; `data_cursor` (an elastic run's position in the global record
        order, `tfgpt.resilience.elastic`) is saved beside them when given.
        """
        counters = [("step", self.step)] + ([("data_cursor", data_cursor)]
                                            if data_cursor is not None else [])
        # The entries are asked for at every save: an elastic run's ranks change.
        return checkpoint_run.RunCheckpointer(config.out, self.distribution,
                                              lambda: self._entries(counters),
                                              keep=config.keep_checkpoints,
                                              after_restore=self.sharding.after_restore,
                                              base=self.base)


def state_line(trained, distribution, sharding):
    """The start-up line with this rank's bytes of parameters, gradients and
    optimizer state of `trained` (a model, or a pipeline's stage)."""
    parameters = sum(int(np.prod(v.shape)) for v in trained.trainable_variables)
    sizes = state_bytes(parameters, sharding.stage, distribution.size,
                        gathered=sharding.largest_unit())
    gib = byte_size
    line = (
        f"state per rank (ZeRO stage {sharding.stage}, "
        f"{distribution.state.ranks_phrase(distribution.size)}): parameters "
        f"{gib(sizes['parameters'])}, gradients {gib(sizes['gradients'])}, optimizer "
        f"{gib(sizes['optimizer'])}, total {gib(sizes['state'])}"
    )
    if sizes["gathered"]:
        line += f", plus {gib(sizes['gathered'])} gathered while the largest unit runs"
    whole = state_bytes(parameters, 0, 1)["state"]
    if sizes["state"] != whole:
        line += f" (stage 0: {gib(whole)})"
    if distribution.size > 1 and hasattr(distribution, "averaging"):
        line += f"; gradients averaged by {distribution.averaging}"
    return line


def run_record(config, distribution):
    """The run's settings for config.json: the config's fields and the front
    end's distribution options (`--fp16-allreduce`, `--strategy`, ...)."""
    record = dataclasses.asdict(config)
    if distribution.options is not None:
        record.update(dataclasses.asdict(distribution.options))
    return record


def run_loop(config, distribution, report, *, model, optimizer, step, train_step, batches,
             checkpointer, steps, global_batch, sequence_length, perplexity=False,
             callbacks=()):
    """Runs steps `step + 1` to `steps`, logging and saving; returns the last logged metrics.

    Every `log_every` steps (and at step 1 and the last), the loss and the
    step's metrics averaged over the window and the workers, the learning
    rate, the gradient norm, tokens/s, sequences/s and MFU (with
    `perplexity`, exp(loss) too; under float16 the loss scale and the
    skipped steps). A NaN or infinite loss stops the run without saving.
    Checkpoints every `save_every` steps and at the end; a callback's
    `should_stop` ends the run after any step with a checkpoint and
    `StoppedEarly`.

    Args:
        config: the run config (`tfgpt.config.training.RunConfig`).
        distribution: a `tfgpt.parallel` object.
        report: `tfgpt.observe.reporter.Reporter`.
        model, optimizer, step: from `build_model_and_optimizer`.
        train_step: `tfgpt.training.train_step.TrainStep`.
        batches: iterator of this worker's batches.
        checkpointer: from `RunPart.checkpointer`.
        steps: int. The step to end at.
        global_batch: int. Sequences per step over all workers.
        sequence_length: int. Tokens per sequence, for tokens/s and MFU.
        perplexity: bool. Log exp(loss) (language-model losses).
        callbacks: `Callback`s, called in order.
    """

    def save(at_step, last_loss):
        if not math.isfinite(last_loss):
            raise TrainingDiverged(
                f"loss is {last_loss} at step {at_step}; not saving it over the last "
                f"good checkpoint ({checkpointer.latest})"
            )
        path = checkpointer.save(at_step)
        for callback in callbacks:
            callback.on_save(at_step)
        return path

    # MFU: the model's FLOPs against this worker's peak, measured on the
    # towers and threads the steps run on.
    flops_per_token = flops.flops_per_token(model, sequence_length)
    if config.peak_flops:
        peak, basis = config.peak_flops, "given"
    else:
        peak, path, now = flops.cached_matmul_peak(
            "float32" if config.mixed_precision == "off" else config.mixed_precision,
            towers=towers_of(config, distribution),
        )
        basis = (f"{'measured now' if now else 'measured earlier on this machine'}: the fastest "
                 f"1024^2 or 2048^2 matmul, one chain per tower; kept in {path}")
    report.info(
        f"MFU basis: {flops_per_token / 1e6:.1f} MFLOP per token (6N + 12 L C T), "
        f"peak {peak / 1e9:.1f} GFLOP/s per worker ({basis})"
    )
    report.info(kernel_summary(config, distribution, model))

    start = int(step.numpy())
    tokens_per_step = global_batch * sequence_length
    metrics, mean_loss = {}, float("nan")
    window_steps, window_sums = 0, {}
    clock = monitor.WindowClock()  # the window's start and its time split
    host = monitor.HostSampler(gpu_index=getattr(distribution, "local_rank", 0))
    rules = None
    if config.monitor_rules == "on":
        rules = monitor.Rules(monitor.hostnames(distribution),
                              pipeline=distribution.state.pipelined)
    profiler = StepProfiler(
        config.profile_range(), os.path.join(config.out, "profile"), distribution.is_chief
    )
    for current in range(start, steps):
        for callback in callbacks:
            callback.on_step_begin(current + 1)
        profiler.before(current + 1)
        waited = time.perf_counter()
        batch = next(batches)
        clock.add("data", time.perf_counter() - waited)
        step_metrics = dict(train_step(batch))
        step_times = step_metrics.pop(STEP_TIMES, None)
        clock.add_step_times(step_times)
        step.assign(current + 1)
        for callback in callbacks:
            callback.on_step_end(current + 1)
        if profiler.after(current + 1, step_metrics, current + 1 == steps):
            report.info(f"profiler trace of steps {config.profile_steps} in {profiler.directory}")
        window_sums = {
            name: window_sums.get(name, 0.0) + value for name, value in step_metrics.items()
        }
        window_steps += 1
        last = current + 1 == steps
        # Windows end at multiples of log_every (and at step 1), so a resumed
        # run logs the same averages as an uninterrupted one.
        if (current + 1) % config.log_every == 0 or last or current == 0:
            # The loss and the task's own metrics, averaged over the window
            # and the workers in one collective.
            names = ["loss"] + sorted(set(window_sums) - {"loss", "gradient_norm"})
            means = distribution.allreduce_mean(
                tf.stack([tf.cast(window_sums[name], tf.float32) for name in names]) / window_steps
            ).numpy()
            mean_loss = float(means[0])
            if not math.isfinite(mean_loss):
                raise TrainingDiverged(
                    f"loss is {mean_loss} at step {current + 1}; stopping without saving "
                    f"(last good checkpoint: {checkpointer.latest})"
                )
            elapsed = clock.elapsed()
            metrics = {"loss": mean_loss}
            if perplexity:
                metrics["perplexity"] = math.exp(min(mean_loss, 50.0))
            metrics.update({
                "learning_rate": float(optimizer.learning_rate),
                "gradient_norm": float(step_metrics["gradient_norm"]),
                **{name: float(value) for name, value in zip(names[1:], means[1:])},
            })
            if config.mixed_precision == "float16":
                metrics["loss_scale"] = float(optimizer.dynamic_scale)
                metrics["skipped_steps"] = float(
                    (current + 1) - int(optimizer.inner_optimizer.iterations)
                )
            # The first step includes tracing and compilation: no rate for it.
            if current + 1 - window_steps > start:
                tokens_per_second = tokens_per_step * window_steps / elapsed
                metrics["tokens_per_second"] = tokens_per_second
                metrics["sequences_per_second"] = tokens_per_second / sequence_length
                metrics["mfu"] = (
                    flops_per_token * tokens_per_second / distribution.num_workers / peak
                )
            shares, rows = monitor.window_figures(distribution, clock, host)
            metrics.update(shares)
            details, fired = {"workers": rows}, []
            # The window of a run's first step holds tracing and start-up.
            if rules is not None and current + 1 - window_steps > start:
                fired = rules.check(current + 1, metrics, rows)
                details["rules"] = [{"rule": rule, "message": message} for rule, message in fired]
            report.scalars(current + 1, metrics, details=details)
            for _, message in fired:
                report.info(f"warning: {message}")
            window_steps, window_sums = 0, {}
            clock.reset()
        saved_now = config.save_every and (current + 1) % config.save_every == 0 and not last
        if saved_now:
            save(current + 1, float(step_metrics["loss"]))
        reasons = [callback.should_stop(current + 1) for callback in callbacks]
        reasons = [reason for reason in reasons if reason]
        if reasons and not last:
            path = (checkpointer.latest if saved_now
                    else save(current + 1, float(step_metrics["loss"])))
            stopped = StoppedEarly(", ".join(reasons), current + 1, path)
            report.info(str(stopped))
            report.close()
            raise stopped
    if int(step.numpy()) > start or not checkpointer.latest:
        saved_path = save(int(step.numpy()), mean_loss)
        if saved_path:
            report.info(f"saved {saved_path}")
    return metrics
