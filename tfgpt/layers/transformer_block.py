"""One transformer block: self-attention and a feed-forward network."""

import keras
import tensorflow as tf

from tfgpt.config.checks import require_one_of
from tfgpt.layers.activated_dense import ActivatedDense
from tfgpt.layers.causal_self_attention import CausalSelfAttention
from tfgpt.layers.configured_layer import ConfiguredLayer, normal_initializer
from tfgpt.layers.rms_norm import RMSNorm
from tfgpt.layers.self_attention import SelfAttention
from tfgpt.parallel.tensor_parallel import SPLIT_RULES, current_slice

# The block's attention, by the name its `attention` argument takes.
ATTENTION_LAYERS = {"causal": CausalSelfAttention, "bidirectional": SelfAttention}


@keras.saving.register_keras_serializable(package="tfgpt")
class TransformerBlock(ConfiguredLayer):
    """A transformer block with residual connections (Vaswani et al. 2017).

    Pre-layer-norm (`norm_first=True`: GPT-2; Xiong et al. 2020):
        x = x + dropout(attention(norm1(x)))
        x = x + dropout(feedforward(norm2(x)))
    Post-layer-norm (`norm_first=False`: the original Transformer, BERT,
    ALBERT):
        x = norm1(x + dropout(attention(x)))
        x = norm2(x + dropout(feedforward(x)))

    The attention is what makes it a decoder or an encoder block, and all
    that differs: `"causal"` is `CausalSelfAttention` (GPT: one fused
    query/key/value projection, a key/value cache for decoding),
    `"bidirectional"` is `SelfAttention` (BERT and ALBERT: separate
    query, key and value projections). Model Garden's ALBERT likewise
    builds on BERT's block instead of a copy.

    Args:
        hidden_dim: int. Width of the residual stream.
        num_heads: int. Attention heads; must divide `hidden_dim`.
        intermediate_dim: int. Width of the feed-forward hidden layer.
        attention: str. `"causal"` or `"bidirectional"`.
        dropout: float. Rate for attention probabilities and both residual
            branches.
        activation: str. `"gelu"`, `"gelu_tanh"` or `"relu"`.
        norm_first: bool. Pre-LN when True, post-LN when False.
        layer_norm_epsilon: float. Epsilon of both layer norms.
        norm: str. `"layer"` (LayerNorm) or `"rms"` (RMSNorm).
        feedforward: str. `"dense"`: `output(activation(intermediate(x)))`;
            `"gated"`: `output(activation(gate(x)) * intermediate(x))`.
        feedforward_bias: bool. Biases on the feed-forward projections.
        residual: str. `"sequential"`, or (pre-norm only) `"parallel"`:
            `x + attention(n(x)) + feedforward(n(x))` with one norm (GPT-J),
            `"parallel_two_norms"`: each branch on its own norm (GPT-NeoX).
        attention_options: dict. More arguments of the causal attention
            (`num_key_value_heads`, `head_dim`, `attention_bias`,
            `output_bias`, `scale`, `rotary`: `CausalSelfAttention`'s).

    Activation recomputation (`block.recompute = True`, or
    `set_recompute(model, True)` for every block of a model) keeps only the
    block's input for the backward pass and runs the block again there
    (`tf.recompute_grad`; Chen et al. 2016): activation memory per block
    drops to one (B, T, C) tensor for about a third more compute. It is a
    training-time choice, not part of the architecture: it is not a
    constructor argument and not in `get_config()`. Gradients are unchanged,
    dropout included (the recomputation replays the same dropout masks).

    Built inside `tfgpt.parallel.tensor_parallel.slice_scope`, the block
    holds its tensor slice (Shoeybi et al. 2019): its attention's slice of
    the heads, and `local_intermediate` of the feed-forward width, the
    first matmul column-parallel (after f) and the second row-parallel
    (its partial products summed by g before the replicated bias). Layer
    norms and residual dropouts are replicated: every rank of the tensor
    group computes them alike, with equal dropout masks.

    Example:
    >>> block = TransformerBlock(hidden_dim=8, num_heads=2, intermediate_dim=32)
    >>> block(keras.ops.zeros((1, 3, 8))).shape
    TensorShape([1, 3, 8])
    >>> encoder_block = TransformerBlock(8, 2, 32, attention="bidirectional")
    >>> encoder_block(keras.ops.zeros((1, 3, 8)), padding_mask=[[1, 1, 0]]).shape
    TensorShape([1, 3, 8])
    """

    # Training-time option, see the class docstring.
    recompute = False
    # Where the block's weights come from while it runs: None reads its
    # variables; sharded training (ZeRO stage 3, `tfgpt.parallel.zero`)
    # sets a callable that takes the block's inputs and returns a context
    # that gathers the weights for the call once those inputs exist.
    weights_scope = None

    def __init__(
        self,
        hidden_dim,
        num_heads,
        intermediate_dim,
        attention="causal",
        dropout=0.0,
        activation="gelu_tanh",
        norm_first=True,
        layer_norm_epsilon=1e-5,
        norm="layer",
        feedforward="dense",
        feedforward_bias=True,
        residual="sequential",
        attention_options=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        require_one_of("attention", attention, ATTENTION_LAYERS)
        require_one_of("norm", norm, ("layer", "rms"))
        require_one_of("feedforward", feedforward, ("dense", "gated"))
        require_one_of("residual", residual, ("sequential", "parallel", "parallel_two_norms"))
        self.record_config(
            hidden_dim=hidden_dim,
            num_heads=num_heads,
            intermediate_dim=intermediate_dim,
            dropout=dropout,
            activation=activation,
            norm_first=norm_first,
            layer_norm_epsilon=layer_norm_epsilon,
            norm=norm,
            feedforward=feedforward,
            feedforward_bias=feedforward_bias,
            residual=residual,
            attention_options=attention_options,
        )
        # The attribute `attention` is the attention layer, built below.
        self.attention_kind = attention
        initializer = normal_initializer()
        self.attention_norm = self._norm("attention_norm")
        self.attention = ATTENTION_LAYERS[attention](
            hidden_dim, num_heads, dropout=dropout, dtype=self.dtype_policy, name="attention",
            **(attention_options or {})
        )
        self.attention_dropout = self._dropout(dropout, "attention_dropout")
        # GPT-J's parallel residual feeds both branches from the one norm.
        self.feedforward_norm = (None if residual == "parallel"
                                 else self._norm("feedforward_norm"))
        self.tensor_slice = current_slice()
        self.local_intermediate = self.tensor_slice.rows(intermediate_dim, "intermediate_dim")[1]
        # The gate's rule is the intermediate's (`SPLIT_RULES`).
        intermediate_initializer = self.tensor_slice.initializer(
            initializer, (hidden_dim, intermediate_dim),
            SPLIT_RULES["feedforward_intermediate/kernel"])
        output_initializer = self.tensor_slice.initializer(
            initializer, (intermediate_dim, hidden_dim), SPLIT_RULES["feedforward_output/kernel"])
        gated = feedforward == "gated"
        # Gated: the activation acts on the gate, the intermediate multiplies it.
        self.feedforward_gate = self._dense(
            self.local_intermediate, "feedforward_gate", intermediate_initializer,
            dense_class=ActivatedDense, activation=activation, use_bias=feedforward_bias,
        ) if gated else None
        self.feedforward_intermediate = self._dense(
            self.local_intermediate,
            "feedforward_intermediate",
            intermediate_initializer,
            dense_class=ActivatedDense,
            activation=None if gated else activation,
            use_bias=feedforward_bias,
        )
        self.feedforward_output = self._dense(hidden_dim, "feedforward_output", output_initializer,
                                              use_bias=feedforward_bias)
        self.feedforward_dropout = self._dropout(dropout, "feedforward_dropout")

    def _norm(self, name):
        if self.norm == "rms":
            return RMSNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)
        return self._layer_norm(self.layer_norm_epsilon, name)

    def build(self, input_shape):
        self.attention_norm.build(input_shape)
        self.attention.build(input_shape)
        if self.feedforward_norm is not None:
            self.feedforward_norm.build(input_shape)
        if self.feedforward_gate is not None:
            self.feedforward_gate.build(input_shape)
        self.feedforward_intermediate.build(input_shape)
        self.feedforward_output.build(input_shape[:-1] + (self.local_intermediate,))
        self.built = True

    def _feedforward(self, x, training):
        x = self.tensor_slice.copy_to_group(x)  # f
        hidden = self.feedforward_intermediate(x)  # (B, T, I), I/T under a slice
        if self.feedforward_gate is not None:
            hidden = self.feedforward_gate(x) * hidden  # (B, T, I)
        x = self.tensor_slice.row_parallel(self.feedforward_output, hidden)  # (B, T, C)
        return self.feedforward_dropout(x, training=training)

    def call(self, inputs, padding_mask=None, cache=None, cache_index=0, positions=None,
             segment_ids=None, training=None):
        """Applies the block to `inputs` (B, T, C).

        `padding_mask` (B, S) marks the real key positions; `cache`,
        `cache_index`, `positions` and `segment_ids` (causal attention
        only) are those of `CausalSelfAttention`, and with a cache the
        updated cache is returned as a second output.
        """
        # Causal attention only: the encoders' attention takes neither.
        extra = {name: value for name, value in
                 (("positions", positions), ("segment_ids", segment_ids)) if value is not None}
        if self.recompute and training and cache is None:
            return self._recomputed(inputs, padding_mask, extra, training)
        return self._apply(inputs, padding_mask, cache, cache_index, extra, training)

    def _recomputed(self, inputs, padding_mask, extra, training):
        # Dropout draws each mask from its SeedGenerator's state and advances
        # it. The recomputation in the backward pass rewinds the states to
        # their values before the forward pass, so it replays the same masks,
        # and then puts back the states it found, so they end where the
        # forward pass left them. (Put back rather than left as the
        # recomputation leaves them: a block applied at several layers, as
        # ALBERT shares its blocks, is recomputed from the last layer to
        # the first, and the first layer's forward pass did not end last.)
        states = [
            variable.value
            for variable in self.variables
            if "seed_generator_state" in variable.path
        ] if self.dropout > 0 else []
        saved = [tf.identity(state) for state in states]
        forward_done = []

        def block(x):
            found = [tf.identity(state) for state in states] if forward_done else []
            forward_done.append(True)
            for state, value in zip(states, saved):
                state.assign(value)
            outputs = self._apply(x, padding_mask, None, 0, extra, training)
            with tf.control_dependencies([outputs]):
                for state, value in zip(states, found):
                    state.assign(value)
            return outputs

        return tf.recompute_grad(block)(inputs)

    def _apply(self, inputs, padding_mask, cache, cache_index, extra, training):
        # Inside the recomputed function: a recomputation gathers again
        # (its inputs wait for the gradient arriving from the layer above).
        if self.weights_scope is not None:
            with self.weights_scope(inputs):
                return self._compute(inputs, padding_mask, cache, cache_index, extra, training)
        return self._compute(inputs, padding_mask, cache, cache_index, extra, training)

    def _compute(self, inputs, padding_mask, cache, cache_index, extra, training):
        x = inputs
        attention_input = self.attention_norm(x) if self.norm_first else x
        if cache is None:
            attended = self.attention(
                attention_input, padding_mask=padding_mask, training=training, **extra
            )
        else:
            attended, cache = self.attention(
                attention_input,
                padding_mask=padding_mask,
                cache=cache,
                cache_index=cache_index,
                training=training,
                **extra,
            )
        attended = self.attention_dropout(attended, training=training)
        if self.residual != "sequential":
            feedforward_input = (attention_input if self.feedforward_norm is None
                                 else self.feedforward_norm(x))
            x = x + attended + self._feedforward(feedforward_input, training)
        elif self.norm_first:
            x = x + attended
            x = x + self._feedforward(self.feedforward_norm(x), training)
        else:
            x = self.attention_norm(x + attended)
            x = self.feedforward_norm(x + self._feedforward(x, training))
        if cache is not None:
            return x, cache
        return x

    def get_config(self):
        return {**super().get_config(), "attention": self.attention_kind}


def set_recompute(model, enabled):
    """Turns activation recomputation on or off in every TransformerBlock of
    `model`; returns how many blocks there are (0: the option does nothing)."""
    blocks = [layer for layer in model.sublayers() if isinstance(layer, TransformerBlock)]
    for block in blocks:
        block.recompute = enabled
    return len(blocks)
