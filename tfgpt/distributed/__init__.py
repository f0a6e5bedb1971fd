"""How gradients, metrics and initial state cross workers.

A distribution object has `rank`, `size`, `is_chief`, and
`allreduce_gradients`, `allreduce_mean` and `broadcast_variables`; the
trainer core calls only these, so one loop serves every front end.

`keras_horovod` runs `model.fit` under Horovod on Keras 3 with such an
object: `DistributedOptimizer`, `BroadcastInitialState`, `AverageMetrics`
and `rank_zero_only`.
"""

from tfgpt.distributed import keras_horovod
from tfgpt.distributed.local import LocalDistribution

__all__ = ["LocalDistribution", "keras_horovod"]
