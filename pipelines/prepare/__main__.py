"""`python -m pipelines.prepare`: see `pipelines.prepare.cli`."""

import signal
import sys

from pipelines.prepare.cli import main

if __name__ == "__main__":
    # SIGTERM (a scheduler's stop) is an interruption like Ctrl-C: finished
    # chunks are kept for the rerun.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
