"""`graph_function`: tf.function without AutoGraph, and what that means for code in it."""

import pytest
import tensorflow as tf

from tfgpt.graph_function import graph_function


def test_a_graph_function_computes_what_the_python_function_does():
    step = graph_function(lambda x, y: tf.matmul(x, y) + 1.0)
    x, y = tf.random.stateless_normal([3, 4], [1, 2]), tf.random.stateless_normal([4, 2], [3, 4])
    assert step(x, y).numpy().tolist() == (tf.matmul(x, y) + 1.0).numpy().tolist()


def test_python_control_flow_on_a_tensor_is_an_error_not_a_silent_branch():
    @graph_function
    def sign(x):
        if x > 0:
            return x
        return -x

    with pytest.raises(TypeError, match="bool"):
        sign(tf.constant(2.0))
    # A while_loop is what tfgpt writes instead.
    count = graph_function(lambda n: tf.while_loop(lambda i: i < n, lambda i: (i + 1,), (0,))[0])
    assert int(count(tf.constant(5))) == 5


def test_asking_for_autograph_is_refused():
    with pytest.raises(ValueError, match="autograph=True"):
        graph_function(lambda x: x, autograph=True)
