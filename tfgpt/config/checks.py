"""Argument checks the config dataclasses share.

Each raises ValueError naming the argument and echoing what it received.
"""


def require_int_at_least(name, value, minimum, wanted=None, types=int):
    """An instance of `types` (never a bool) of at least `minimum`.

    The message says the argument must be `wanted`, by default
    "an integer >= minimum".
    """
    if isinstance(value, bool) or not isinstance(value, types) or value < minimum:
        wanted = wanted or f"an integer >= {minimum}"
        raise ValueError(f"`{name}` must be {wanted}. Received: {name}={value!r}")


def require_positive_int(name, value):
    require_int_at_least(name, value, 1, "a positive integer")


def require_non_negative_int(name, value):
    require_int_at_least(name, value, 0, "a non-negative integer")


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_positive_number(name, value):
    if not _is_number(value) or not value > 0:
        raise ValueError(f"`{name}` must be positive. Received: {name}={value!r}")


def require_fraction(name, value):
    """A rate in [0, 1), such as a dropout rate."""
    if not _is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"`{name}` must be in [0, 1). Received: {name}={value!r}")


def require_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")


def require_one_of(name, value, choices):
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {tuple(choices)}. Received: {name}={value!r}"
        )


def require_divisible(name, value, divisor_name, divisor):
    if value % divisor:
        raise ValueError(
            f"`{name}` must be divisible by `{divisor_name}`. "
            f"Received: {name}={value}, {divisor_name}={divisor}"
        )


def require_towers_divide_batch(batch_size, towers):
    """Raises unless `towers` (0: chosen later) divides `batch_size`."""
    if towers:
        require_divisible("batch_size", batch_size, "towers", towers)
