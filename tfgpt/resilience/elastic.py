"""Elastic Horovod training: workers lost or added mid-run (`train_hvd.py --elastic`).

Under `horovodrun --min-np M --max-np X --host-discovery-script S`,
Horovod's elastic driver starts workers on the slots the script lists,
notices the ones that die and starts new ones on slots that appear. The
run goes on through those changes in formations (one set of workers
each), every one a call of `loop.run_loop`:

- every `--commit-every` steps each worker commits: `ElasticState` copies
  the run's variables (model, dropout seeds, optimizer with its step count
  and loss scale, the step, the data position) to host memory;
- a lost worker makes the others' next collective fail: they restore the
  last commit, Horovod re-forms without it, and the loop goes on from
  that step (the steps after the commit are done again);
- a slot that appears is noticed at the next commit (Horovod raises
  `HostsUpdatedInterrupt` there): the job re-forms with the new worker,
  which receives rank 0's state (`ElasticState.sync`);
- each formation reads rank and size again, gives the optimizer the
  schedule of that many workers (with `--scale-learning-rate` the peak
  is `--learning-rate` x workers, as for a run resumed on another worker
  count) and traces a new step, since traced steps hold the old size;
- the data: every worker reads the global record order from the committed
  cursor (`pipelines.reader.global_records`), every N-th record from its
  rank on, so each sequence of an epoch is used once however the world
  size changes.

World-size rule: each worker keeps `--batch-size` (and its accumulation
steps), so the global batch is `batch_size x accumulation_steps x
workers` and changes with the world size, as the learning rate does.

Horovod's own `TensorFlowKerasState` predates Keras 3, and
`hvd.elastic.run` recognises a failed collective only by the names of
single allreduces, allgathers and broadcasts (not the grouped
allreduces of `HorovodDistribution`); `ElasticState` and `run` are this
module's own, on `horovod.common.elastic`.
"""

import contextlib
import os

import keras
import numpy as np
import tensorflow as tf

from tfgpt.checkpoint import read_config
from tfgpt.checkpoint.files import Reader
from tfgpt.optim.optimizers import set_worker_count
from tfgpt.resilience import faults
from tfgpt.training import loop

# config.json's key naming the elastic job that wrote it (`joins_running_job`).
JOB_KEY = "elastic_job"


def job():
    """This elastic horovodrun's identity (its rendezvous address), or None
    outside an elastic horovodrun (no `--host-discovery-script`)."""
    if os.environ.get("HOROVOD_ELASTIC") != "1":
        return None
    return (f"{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_ADDR')}:"
            f"{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT')}")


def joins_running_job(out):
    """Whether this worker joins the elastic job that writes `out`.

    A worker that Horovod starts mid-run (added, or replacing a lost one)
    finds the job's own checkpoints in `out`: it neither refuses them nor
    restores them, since rank 0 sends it the state. It is recognised by
    config.json, which the job's chief wrote with this horovodrun's
    rendezvous address.
    """
    current = job()
    if current is None:
        return False
    try:
        return read_config(out).get(JOB_KEY) == current
    except FileNotFoundError:
        return False


def check_config(config, task_name):
    """Raises, before anything is built, for what `--elastic` cannot do."""
    if task_name not in ("clm", "sft"):
        raise ValueError(
            f"--elastic reads a decoder's records (--task clm or sft) in one global order; "
            f"--task {task_name} is not supported with it"
        )
    if config.skip_corrupt:
        raise ValueError(
            "--elastic needs every worker to read the same global order of records: "
            "--skip-corrupt would leave out different shards on different workers"
        )


def check_resumable(path, flag):
    """Raises unless the checkpoint at `path` holds a position in the global
    record order, which `flag` (`--elastic`, `--global-order`) resumes from."""
    if "data_cursor" not in Reader(path).keys:
        raise ValueError(
            f"{flag} --resume: {path} was written without --elastic or --global-order and has "
            f"no position in the global record order; resume it without {flag}"
        )


@contextlib.contextmanager
def _failed_collectives_raise_internal_errors():
    # What Horovod's elastic loop restores and re-forms after: a
    # TensorFlow error of a Horovod op (a peer is gone).
    from horovod.common.exceptions import HorovodInternalError

    try:
        yield
    except tf.errors.OpError as error:
        if "Horovod" not in (error.message or ""):
            raise
        raise HorovodInternalError(error) from error


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def elastic_state(variables):
    """An `ElasticState` of `variables` (see its class, built on Horovod's)."""
    import horovod.tensorflow as hvd
    from horovod.common.elastic import State
    from horovod.tensorflow.functions import broadcast_object

    class ElasticState(State):
        """The run's variables, committed to host memory; rank 0's on every new formation.

        Args:
            variables: list of Keras or tf.Variables: everything a worker
                must return to after a failure and a new worker must receive.

        `formation` counts the formations this job has gone through: never
        rolled back, the same on every worker (rank 0's after `sync`).
        """

        def __init__(self, variables):
            super().__init__(bcast_object=broadcast_object, get_rank=hvd.rank)
            self.variables = [_tf_variable(v) for v in variables]
            self.formation = 0
            self._committed = self._copy()

        def _copy(self):
            return [v.numpy() for v in self.variables]

        def save(self):
            self._committed = self._copy()

        def restore(self):
            for variable, value in zip(self.variables, self._committed):
                variable.assign(value)

        def sync(self):
            with _failed_collectives_raise_internal_errors():
                if hvd.size() > 1:
                    hvd.broadcast_variables(self.variables, root_rank=0)
                self.formation = self._bcast_object(self.formation)
            self._committed = self._copy()

    return ElasticState(variables)


def run(function):
    """`function(state)` again after every re-formation, until it returns.

    Horovod's `run_fn` syncs the state before each call, restores the last
    commit after a failed collective (`HorovodInternalError`) and restarts
    Horovod (`shutdown`, `init`: the new formation's rendezvous) before
    calling again. Any TensorFlow error naming Horovod, in `function` or
    in the sync, is such a failure.
    """
    import horovod.tensorflow as hvd
    from horovod.common.elastic import run_fn

    def translated(state):
        with _failed_collectives_raise_internal_errors():
            return function(state)

    def reset():
        hvd.shutdown()
        hvd.init()

    return run_fn(translated, reset)


def _logging_records(batches, directory, formation, first_step, distribution, variables):
    # faults.RECORD_LOG: the state each step of each formation started from
    # (`variables` as the loop draws the step's batch) and the sequences it read.
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"records-{os.getpid()}.txt"), "a") as log:
        for index, batch in enumerate(batches):
            # (..., B, T) inputs and (..., B, T) targets -> rows of T + 1 tokens
            # (instruction batches: their loss weights and segments after them).
            inputs, targets = batch[:2]
            tokens = np.concatenate([inputs.numpy(), targets.numpy()[..., -1:]], axis=-1)
            rows = tokens.reshape(-1, tokens.shape[-1])
            log.write(
                f"{formation} {first_step + index + 1} {distribution.size} {distribution.rank} "
                f"{faults.state_fingerprint(variables)} "
                + " ".join(faults.fingerprint(row) for row in rows) + "\n"
            )
            log.flush()
            yield batch


def run_formations(config, options, distribution, report, *, model, optimizer, step, data_cursor,
                   build_train_step, build_batches, checkpointer, sequence_length, callbacks=()):
    """Trains to `config.steps` through every change of the world size; returns the last metrics.

    Args:
        config: TrainConfig.
        options: `tfgpt.config.distribution.PretrainingHorovodOptions`.
        distribution: `HorovodDistribution`; its rank and size are read
            again at each formation.
        report: `Reporter`; the formation's rank 0 writes.
        model, optimizer, step: from `loop.build_model_and_optimizer`.
        data_cursor: int64 tf.Variable. Records of the global order
            consumed so far.
        build_train_step: callable `()` -> a new `TrainStep` (traced anew).
        build_batches: callable `(cursor)` -> this worker's batches from
            position `cursor` of the global order.
        checkpointer: the run's `RunCheckpointer` (it asks who the chief is
            at each save).
        sequence_length: int. Tokens per sequence.
        callbacks: the loop's other `tfgpt.training.loop.Callback`s.
    """
    state = elastic_state(model.variables + optimizer.variables + [step, data_cursor])
    record_log = os.environ.get(faults.RECORD_LOG)

    def formation(state):
        state.formation += 1
        distribution.read_world()
        report.set_chief(distribution.is_chief)
        schedule = set_worker_count(optimizer, config, distribution.size)
        records_per_step = config.batch_size * config.accumulation_steps * distribution.size
        first_step, cursor = int(step.numpy()), int(data_cursor.numpy())
        report.info(
            f"elastic: formation {state.formation}, {distribution.size} worker(s) from step "
            f"{first_step} at data position {cursor}: global batch {records_per_step}, "
            f"peak learning rate {schedule.peak:g}"
        )
        batches = build_batches(cursor)
        if record_log:
            batches = _logging_records(batches, record_log, state.formation, first_step,
                                       distribution, model.variables)

        def after_step(done):
            data_cursor.assign_add(records_per_step)
            if done % options.commit_every == 0 and done < config.steps:
                state.commit()  # raises HostsUpdatedInterrupt when a slot appeared

        return loop.run_loop(
            config, distribution, report, model=model, optimizer=optimizer, step=step,
            train_step=build_train_step(), batches=batches, checkpointer=checkpointer,
            steps=config.steps, global_batch=records_per_step, sequence_length=sequence_length,
            perplexity=True, callbacks=[*callbacks, loop.EachStep(after_step)],
        )

    return run(formation)(state)
