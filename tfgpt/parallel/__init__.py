"""How gradients, metrics and initial state cross workers.

A distribution object has `rank`, `size`, `is_chief`, and
`allreduce_gradients`, `allreduce_mean` and `broadcast_variables`; the
trainer core calls only these, so one loop serves every front end.

`keras_horovod` runs `model.fit` under Horovod on Keras 3 with such an
object: `DistributedOptimizer`, `BroadcastInitialState`, `AverageMetrics`
and `rank_zero_only`.

Every distribution has a `state` (`state.ParallelState`: data x pipeline x
tensor sizes, this rank's coordinates, ZeRO's stage), and `refusals` is the
one table of what the layouts do not combine with. Those two import
neither TensorFlow nor Horovod; `LocalDistribution` is imported on first
use.
"""

from tfgpt.lazy import lazy_exports

__all__ = ["LocalDistribution"]
__getattr__, __dir__ = lazy_exports(__name__, {"LocalDistribution": "tfgpt.parallel.local"})
