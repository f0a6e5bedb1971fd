"""What the kernel tests share: a GPT's loss and gradients as a function
to trace with and without the fused kernels, and the op types of a trace."""

import tensorflow as tf


def gpt_loss_and_gradients(model, inputs, targets):
    """A function of no arguments returning the model's training-mode
    cross-entropy on (inputs, targets) and its gradients, one per trainable
    variable (traced anew under each `tf.function`)."""
    from tfgpt.training.train_step import cross_entropy

    def loss_and_gradients():
        with tf.GradientTape() as tape:
            loss = cross_entropy(targets, model(inputs, training=True))
        return loss, tape.gradient(loss, [v.value for v in model.trainable_variables])

    return loss_and_gradients


def traced_op_types(function):
    """The op types in the graph of a `tf.function` of no arguments."""
    return {op.type for op in function.get_concrete_function().graph.get_operations()}
