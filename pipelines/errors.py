"""The error raised for bad data: inputs, shards and manifests."""


class DataError(ValueError):
    """Bad user data: an unreadable or malformed input, a missing or corrupted shard.

    A subclass of ValueError, so `except ValueError` also catches it. The
    message always names the offending file (and line, for input files), e.g.
    `data.jsonl:17: malformed JSON line (Expecting value: column 1)`.
    """
