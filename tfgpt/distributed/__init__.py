"""How gradients, metrics and initial state cross workers.

A distribution object has `rank`, `size`, `is_chief`, and
`allreduce_gradients`, `allreduce_mean` and `broadcast_variables`; the
trainer core calls only these, so one loop serves every front end.
"""

from tfgpt.distributed.local import LocalDistribution

__all__ = ["LocalDistribution"]
