"""Several runs of one check script in one process: `many.py SCRIPT RUNS`.

RUNS is a JSON list; each item is one run's arguments to SCRIPT (`OUT TAG
FLAGS...`), which must define `main(argv)`, or `{"argv": [...], "env":
{...}, "status": N}`: the arguments, environment variables set for that
run alone, and the status its `main` must return (0, or None, unless
given; a run that returns another ends the launch with status 1). The
runs go one after another,
in order, each from a cleared Keras session (layer names, the random seed
generators, the dtype policy), so each starts as it would in a process of
its own. A Horovod process set a run added is removed when it ends (every
rank removes it: the call is collective), so the next run's layout adds
its own. Under `horovodrun` every rank runs the same list.

What it saves: one start-up (horovodrun, importing TensorFlow, `hvd.init`)
for all the runs of one launch instead of one each (`tests/launch.py`,
`run_each`).
"""

import contextlib
import importlib.util
import json
import os
import sys


def main(script, runs):
    # Layouts with tensor or pipeline groups add process sets after hvd.init;
    # set before any run starts Horovod.
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    spec = importlib.util.spec_from_file_location("check_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import keras

    for index, run in enumerate(runs):
        if isinstance(run, list):
            run = {"argv": run}
        if index:
            keras.backend.clear_session()
        with _process_sets_removed_after(), _environment(run.get("env", {})):
            status = module.main(run["argv"]) or 0
        if status != run.get("status", 0):
            print(f"many.py: run {index} ended with status {status}, not "
                  f"{run.get('status', 0)}: {run['argv']}", file=sys.stderr, flush=True)
            sys.exit(1)


@contextlib.contextmanager
def _environment(variables):
    """`os.environ` with `variables` set, inside."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _process_sets_removed_after():
    """Removes the Horovod process sets added inside, when it ends."""
    import horovod.tensorflow as hvd

    added, original = [], hvd.add_process_set

    def add_process_set(ranks):
        added.append(original(ranks))
        return added[-1]

    hvd.add_process_set = add_process_set
    try:
        yield
    finally:
        hvd.add_process_set = original
    for process_set in added:
        hvd.remove_process_set(process_set)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
