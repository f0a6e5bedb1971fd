"""`graph_function`: `tf.function` without AutoGraph, as tfgpt compiles every step.

AutoGraph rewrites the source of each Python function a trace calls (the
model's layers, the loss, the optimizer's update) so that Python `if`,
`for` and `while` on tensors become graph control flow. tfgpt's compiled
code has none: its loops over tensors are written as `tf.while_loop`, and
its Python branches test Python values (a config field, a layer's
settings). For such code the rewrite changes nothing in the graph and costs
seconds of start-up per trace: a 4-step run of a 3-layer gpt spent about
8 of its 23 s in it on a 2-core AMD EPYC Zen 3 (cProfile of
`train_hvd.py`; bench/RESULTS.md, "Test suite").

Without AutoGraph a Python `if` or `for` on a tensor inside the function
is an error at trace time ("using a `tf.Tensor` as a Python `bool` is not
allowed in Graph execution"), never a silently different graph.

Example:
>>> import tensorflow as tf
>>> double = graph_function(lambda x: 2 * x)
>>> int(double(tf.constant(3)))
6
"""

import tensorflow as tf


def graph_function(function=None, **options):
    """`tf.function(function, autograph=False, **options)`; a decorator when `function` is None."""
    if "autograph" in options:
        raise ValueError(
            "`graph_function` always compiles without AutoGraph; call tf.function for "
            f"AutoGraph. Received: autograph={options['autograph']!r}"
        )
    return tf.function(function, autograph=False, **options)
