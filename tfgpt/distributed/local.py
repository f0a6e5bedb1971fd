"""A single process: every collective is the identity."""


class LocalDistribution:
    """One worker; nothing to average or broadcast."""

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    is_chief = True

    def allreduce_gradients(self, gradients):
        return gradients

    def allreduce_mean(self, value):
        return value

    def broadcast_variables(self, variables):
        del variables
