"""Resuming and locking for `pipelines.prepare`: the output directory between runs.

`.prepare-state.json` (`STATE_FILENAME`) records the scan's results, the
tokenizer and every finished chunk's shards with their SHA-256. A rerun of
the same command (same inputs, by path, size and mtime, and same flags)
re-verifies those shards' checksums, keeps the intact ones and encodes only
the other chunks; if anything differs it starts over. An error removes the
temporary files (`remove_temporary_files`); an interruption keeps them.

`DirectoryLock` holds an exclusive flock on `.prepare.lock`
(`LOCK_FILENAME`) for the whole run, so two runs never write one directory.
"""

import fcntl
import json
import os
from typing import List, Optional

from pipelines.errors import DataError
from pipelines.files import file_sha256, write_atomically
from pipelines.manifest import MANIFEST_FILENAME, SHARD_FILENAME_PATTERN
from pipelines.prepare.shard_writer import TEMPORARY_SHARD_PATTERN
from pipelines.prepare.tokenizer_training import TEMPORARY_TOKENIZER_NAMES

STATE_FILENAME = ".prepare-state.json"
LOCK_FILENAME = ".prepare.lock"
STATE_VERSION = 1


def existing_dataset_files(directory: str) -> List[str]:
    """The final shards and manifest a directory already holds (an earlier dataset)."""
    return sorted(
        name
        for name in os.listdir(directory)
        if SHARD_FILENAME_PATTERN.match(name) or name == MANIFEST_FILENAME
    )


def remove_temporary_files(directory: str) -> None:
    """Delete temporary files and the resume state (this run's or a crashed run's)."""
    for name in os.listdir(directory):
        if (
            TEMPORARY_SHARD_PATTERN.match(name)
            or name in TEMPORARY_TOKENIZER_NAMES
            or name == STATE_FILENAME
        ):
            os.remove(os.path.join(directory, name))


def _chunk_temporary_names(directory: str, chunk_index: int) -> List[str]:
    marker = f"-c{chunk_index:05d}-"
    return [
        name
        for name in os.listdir(directory)
        if TEMPORARY_SHARD_PATTERN.match(name) and marker in name
    ]


class DirectoryLock:
    """An exclusive flock on `.prepare.lock`; the file is removed on release."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILENAME)
        self.file_descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.file_descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.file_descriptor)
            raise DataError(
                f"{directory}: another pipelines.prepare is writing to this directory "
                f"(it holds {LOCK_FILENAME}); wait for it to finish"
            ) from None
        os.ftruncate(self.file_descriptor, 0)
        os.write(self.file_descriptor, f"{os.getpid()}\n".encode("ascii"))

    def release(self) -> None:
        if self.file_descriptor is not None:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            os.close(self.file_descriptor)
            self.file_descriptor = None


def _sha256_of_file(path: str) -> Optional[str]:
    try:
        return file_sha256(path)
    except OSError:
        return None


def write_state(directory: str, state: dict) -> None:
    """Replace the resume state, atomically: a crash leaves the old one or the new one."""
    write_atomically(
        os.path.join(directory, STATE_FILENAME), (json.dumps(state) + "\n").encode("utf-8")
    )


def _read_state(directory: str) -> Optional[dict]:
    path = os.path.join(directory, STATE_FILENAME)
    try:
        with open(path, encoding="utf-8") as state_file:
            state = json.load(state_file)
    except (OSError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else None


def resumable_state(directory: str, settings: dict, log) -> Optional[dict]:
    """An interrupted run's state if it can be resumed; otherwise clear its files, None."""
    state = _read_state(directory)
    if state is not None and state.get("settings") != settings:
        log("found an interrupted run with other inputs or flags: starting over")
        state = None
    if state is not None and (
        _sha256_of_file(os.path.join(directory, state["tokenizer_file"]))
        != state["tokenizer_sha256"]
    ):
        log("the interrupted run's tokenizer is missing or altered: starting over")
        state = None
    if state is None:
        remove_temporary_files(directory)
    return state


def verified_chunks(directory: str, state: dict, log) -> dict:
    """Finished chunks of an interrupted run whose shards all match their SHA-256."""
    verified = {}
    for key, result in state.get("chunks", {}).items():
        intact = all(
            _sha256_of_file(os.path.join(directory, shard["temporary_name"])) == shard["sha256"]
            for summary in result["splits"].values()
            for shard in summary["shards"]
        )
        if intact:
            verified[int(key)] = result
        else:
            log(f"chunk {key}: a shard is missing or altered; encoding the chunk again")
            for name in _chunk_temporary_names(directory, int(key)):
                os.remove(os.path.join(directory, name))
    return verified


def finished_chunks(directory: str, state: dict, log) -> dict:
    """The interrupted run's intact chunks; every other chunk's temporary shards are removed.

    Returns:
        dict. Chunk index -> the chunk's result, as recorded in the state
        (which is rewritten to hold only these chunks).
    """
    chunk_results = verified_chunks(directory, state, log)
    state["chunks"] = {str(index): result for index, result in chunk_results.items()}
    write_state(directory, state)
    for name in os.listdir(directory):
        match = TEMPORARY_SHARD_PATTERN.match(name)
        if match and not (match.group(2) and int(match.group(2)[1:-1]) in chunk_results):
            os.remove(os.path.join(directory, name))  # A chunk that did not finish.
    return chunk_results
