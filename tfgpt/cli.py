"""What every tfgpt command line shares: its help layout.

`HelpFormatter` keeps a docstring's usage example on its own lines and
shows each flag's default; every command's parser uses it, so `--help`
reads the same everywhere. Importing this module does not import
TensorFlow (nor does `--help` of any command).
"""

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Description verbatim (usage examples stay on their own lines), defaults shown."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=100)
