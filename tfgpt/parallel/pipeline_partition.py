"""Cutting a stack of blocks into contiguous pipeline stages.

`uniform` gives every stage the same number of blocks (the first
`num_layers % stages` one more); `balanced` evens out the forward FLOPs
per token, counting the token embedding's lookup with the first stage (no
FLOPs) and the final norm and the projection to the vocabulary (2 V C,
as much as a block of a small model) with the last, which then gets fewer
blocks. Importing this module does not import TensorFlow.
"""

from tfgpt.config.checks import require_one_of
from tfgpt.config.distribution import PIPELINE_PARTITIONS as PARTITIONS


def check_partition(num_layers, parts):
    """Raises unless every one of `parts` stages can have a block."""
    if parts > num_layers:
        raise ValueError(
            "--pipeline-parallel x --virtual-stages must not exceed the model's "
            f"--num-layers: each stage needs a block. Received: {parts} stages, "
            f"num_layers={num_layers}"
        )


def _uniform(num_layers, parts):
    counts = [num_layers // parts + (index < num_layers % parts) for index in range(parts)]
    starts = [sum(counts[:index]) for index in range(parts)]
    return [(start, start + count) for start, count in zip(starts, counts)]


def _balanced(num_layers, parts, block_cost, first_cost, last_cost):
    # Exhaustive over cut points by dynamic programming: best[p][n] is the
    # smallest possible largest cost of p stages holding the first n blocks.
    def cost(start, end, index):
        return ((end - start) * block_cost + (first_cost if index == 0 else 0)
                + (last_cost if index == parts - 1 else 0))

    infinity = float("inf")
    best = [[infinity] * (num_layers + 1) for _ in range(parts + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for part in range(1, parts + 1):
        for end in range(part, num_layers - (parts - part) + 1):
            for start in range(part - 1, end):
                value = max(best[part - 1][start], cost(start, end, part - 1))
                if value < best[part][end]:
                    best[part][end], cut[part][end] = value, start
    ranges, end = [], num_layers
    for part in range(parts, 0, -1):
        start = cut[part][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def partition_blocks(num_layers, parts, method="uniform", block_cost=1.0, first_cost=0.0,
                     last_cost=0.0):
    """`[(start, end)]` block ranges, one per stage, contiguous and in order.

    Args:
        num_layers: int. Blocks in the model.
        parts: int. Stages (virtual stages with interleaving).
        method: str. `uniform` or `balanced`.
        block_cost: float. Cost of one block (`balanced`).
        first_cost, last_cost: float. What the first stage (embeddings) and
            the last (final norm, head, loss) add (`balanced`).

    Example:
    >>> partition_blocks(5, 2)
    [(0, 3), (3, 5)]
    >>> partition_blocks(6, 2, "balanced", block_cost=1.0, last_cost=2.0)
    [(0, 4), (4, 6)]
    """
    require_one_of("pipeline_partition", method, PARTITIONS)
    check_partition(num_layers, parts)
    if method == "uniform":
        return _uniform(num_layers, parts)
    return _balanced(num_layers, parts, block_cost, first_cost, last_cost)
