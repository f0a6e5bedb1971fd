"""Argument checks the config dataclasses share."""


def require_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}"
        )


def require_towers_divide_batch(batch_size, towers):
    """Raises unless `towers` (0: chosen later) divides `batch_size`."""
    if towers and batch_size % towers:
        raise ValueError(
            "`batch_size` must be divisible by `towers`. "
            f"Received: batch_size={batch_size}, towers={towers}"
        )
