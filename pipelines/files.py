"""Durable file writes and checksums shared by the writers and readers of data directories.

A crash (or `kill -9`) must never leave a half-written file under a final
name: `write_atomically` writes a fsynced temporary file and renames it,
and `fsync_directory` makes renames durable. `file_sha256` is the
checksum the manifest and the resume state record for every file.
"""

import hashlib
import os
from typing import Callable


def write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` via a fsynced temporary file and a rename.

    The temporary file is `.<name>.tmp` next to `path`, created with the
    process umask like any other output file.
    """
    directory, name = os.path.split(os.path.abspath(path))
    temporary_path = os.path.join(directory, f".{name}.tmp")
    if os.path.exists(temporary_path):
        os.remove(temporary_path)  # Left over by an interrupted earlier write.
    file_descriptor = os.open(temporary_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(file_descriptor, "wb") as output_file:
            output_file.write(data)
            output_file.flush()
            os.fsync(output_file.fileno())
        os.replace(temporary_path, path)
    except BaseException:
        if os.path.exists(temporary_path):
            os.remove(temporary_path)
        raise


def fsync_directory(directory: str) -> None:
    """Make renames in `directory` durable."""
    file_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(file_descriptor)
    finally:
        os.close(file_descriptor)


def file_sha256(path: str, open_file: Callable = open) -> str:
    """Hex SHA-256 of a file, read in 8 MiB blocks.

    Args:
        path: str.
        open_file: callable. Opens `(path, "rb")`; e.g. `tf.io.gfile.GFile`
            for paths on remote file systems.
    """
    digest = hashlib.sha256()
    with open_file(path, "rb") as input_file:
        while True:
            block = input_file.read(8 << 20)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()
