"""What every tfgpt command line shares: its help layout and its sizes.

`HelpFormatter` keeps a docstring's usage example on its own lines and
shows each flag's default; every command's parser uses it, so `--help`
reads the same everywhere. `byte_size` writes every size a command
prints. Importing this module does not import TensorFlow (nor does
`--help` of any command).
"""

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Description verbatim (usage examples stay on their own lines), defaults shown."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=100)


def byte_size(count):
    """`count` bytes in KiB below one MiB, in MiB, or in GiB from one on."""
    if count < 2**20:
        return f"{count / 2**10:.1f} KiB"
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"
