"""Keeps TensorFlow's start-up noise off a CPU machine's terminal.

Imported by `tfgpt/__init__.py`, so it runs before any tfgpt module imports
TensorFlow. Each setting is a default: a variable already in the
environment wins (`TF_CPP_MIN_LOG_LEVEL=0` brings every C++ log line back).
"""

import os


def quiet_tensorflow():
    """Sets the environment so that TensorFlow starts silently on a CPU."""
    # TensorFlow's C++ INFO and WARNING lines (oneDNN notices, CPU feature
    # guards, "Could not find cuda drivers"); errors still print.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
