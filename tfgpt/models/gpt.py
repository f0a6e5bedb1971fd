"""GPT: a decoder-only transformer language model."""

import keras
import tensorflow as tf

from tfgpt import decoding
from tfgpt.config import GPTConfig
from tfgpt.layers.segments import segment_positions
from tfgpt.layers.token_and_position_embedding import TokenAndPositionEmbedding
from tfgpt.models.block_stack import BlockStack
from tfgpt.models.configured_model import ConfiguredModel
from tfgpt.parallel.tensor_parallel import SPLIT_RULES, current_slice


@keras.saving.register_keras_serializable(package="tfgpt")
class GPT(BlockStack, ConfiguredModel):
    """Decoder-only transformer language model (Radford et al. 2018, 2019).

    Token and position embeddings, `num_layers` causal transformer blocks, a
    final layer norm (pre-LN only) and a projection to the vocabulary, tied
    to the token embedding by default. Returns float32 logits of shape
    (B, T, vocabulary_size) whatever the dtype policy, so the loss and its
    softmax run in float32 under mixed precision.

    The config's switches make the later decoders from the same parts
    (`tfgpt.config.GPTConfig`): RMSNorm, rotary positions (no position
    table), grouped-query attention, gated feed-forward networks, parallel
    residuals, biases on or off, an untied head with a bias: Llama,
    Mistral, Qwen2, GPT-J and GPT-NeoX are presets and conversions of this
    one model.

    Built inside `tfgpt.parallel.tensor_parallel.slice_scope` (tensor
    parallelism, `--tensor-parallel`), each rank holds its slice of every
    block and of the vocabulary, and returns the logits of its own
    `vocabulary_size / T` ids (B, T, V/T): the loss takes them as they
    are (`TensorSlice.cross_entropy`), the logits are never gathered.

    The decoder interface, which `call` runs in a row and pipeline stages
    (`tfgpt.parallel.pipeline_stage`) run piece by piece: `embed(token_ids)`
    (B, T, C), the `blocks` (`TransformerBlock`s), `final_norm` (None after
    post-norm blocks) and `logits(hidden)` (B, T, V); `empty_cache` sizes
    the key/value cache by the key-value heads.

    Args:
        The fields of `tfgpt.config.GPTConfig`, as keyword arguments, and
        Keras's (`name`, `dtype`, ...). Each field is also an attribute.

    Example:
    >>> model = GPT.from_preset("gpt-demo", num_layers=2)
    >>> logits = model(tf.constant([[1, 2, 3]]))
    >>> logits.shape
    TensorShape([1, 3, 2000])
    """

    config_class = GPTConfig

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        config = self.config
        self.embeddings = TokenAndPositionEmbedding(
            self.vocabulary_size,
            self.max_sequence_length,
            self.hidden_dim,
            dropout=self.dropout,
            learned_positions=config.positions == "learned",
            dtype=policy,
            name="embeddings",
        )
        rotary = None
        if config.positions == "rotary":
            rotary = {
                "dim": config.rotary_dim, "interleaved": config.rotary_interleaved,
                "theta": config.rope_theta, "scaling": config.rope_scaling,
                "factor": config.rope_factor,
                "low_frequency_factor": config.rope_low_frequency_factor,
                "high_frequency_factor": config.rope_high_frequency_factor,
                "original_max_length": config.rope_original_max_length,
            }
        self._add_blocks(
            self.num_layers, attention="causal", norm=config.norm,
            feedforward=config.feedforward, feedforward_bias=config.feedforward_bias,
            residual=config.residual,
            attention_options=[{
                "num_key_value_heads": config.key_value_heads,
                "head_dim": config.key_width,
                "attention_bias": config.attention_bias,
                "output_bias": config.output_bias,
                "scale": config.scale_attention,
                "window": config.window_of(index),
                "rotary": rotary,
            } for index in range(self.num_layers)],
        )
        self.tensor_slice = current_slice()
        self.lm_head = None
        if not self.tie_embeddings:
            self.lm_head = keras.layers.Dense(
                self.tensor_slice.rows(self.vocabulary_size, "vocabulary_size")[1],
                use_bias=config.lm_head_bias,
                kernel_initializer=self.tensor_slice.initializer(
                    keras.initializers.RandomNormal(stddev=0.02),
                    (self.hidden_dim, self.vocabulary_size), SPLIT_RULES["lm_head/kernel"]),
                dtype=policy, name="lm_head",
            )
        self.build((None, None))

    def build(self, input_shape):
        hidden_shape = tuple(input_shape) + (self.hidden_dim,)
        self.embeddings.build(input_shape)
        self._build_blocks(hidden_shape)
        if self.lm_head is not None:
            self.lm_head.build(hidden_shape)
        self.built = True

    def call(
        self,
        token_ids,
        padding_mask=None,
        cache=None,
        cache_index=0,
        positions=None,
        segment_ids=None,
        training=None,
    ):
        """Returns next-token logits (B, T, V) in float32.

        Args:
            token_ids: int tensor (B, T).
            padding_mask: optional (B, S) mask of real key positions.
            cache: optional key/value cache: one (B, num_layers, 2, H, S, D)
                tensor (`empty_cache`), or a list with one entry per layer,
                a (B, 2, H, S, D) tensor or a `(key, value)` pair of
                (B, H, S, D) tensors. When given, the updated cache, in the
                same form, is returned after the logits. The list of pairs
                spares a decoding loop from slicing and re-stacking the whole
                cache at every step (`tfgpt.decoding` uses it).
            cache_index: position of `token_ids[:, 0]` in the cache.
            positions: optional explicit positions (B, T) for left padding.
            segment_ids: optional int tensor (B, S), S as for `padding_mask`:
                packed rows, each token's example (1, 2, ...; 0: padding).
                Each example attends within itself and its positions start
                at 0 (unless `positions` are given), as if it were alone in
                a row (`tfgpt.layers.segments`).
            training: bool. Enables dropout.
        """
        if segment_ids is not None and positions is None:
            positions = segment_positions(segment_ids, cache_index,
                                          tf.shape(token_ids)[1])  # (B, T)
        x = self.embed(token_ids, start_index=cache_index, positions=positions,
                       training=training)  # (B, T, C)
        # Rotary positions enter each attention: its default, from cache_index, or
        # these; and the segments, which confine it to each packed example.
        attention = {} if positions is None else {"positions": positions}
        if segment_ids is not None:
            attention["segment_ids"] = segment_ids
        per_layer = isinstance(cache, (list, tuple))
        new_caches = []
        for index, block in enumerate(self.blocks):
            if cache is None:
                x = block(x, padding_mask=padding_mask, training=training, **attention)
            else:
                x, layer_cache = block(
                    x,
                    padding_mask=padding_mask,
                    cache=cache[index] if per_layer else cache[:, index],
                    cache_index=cache_index,
                    training=training,
                    **attention,
                )
                new_caches.append(layer_cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        logits = self.logits(x)  # (B, T, V)
        if per_layer:
            return logits, new_caches  # L x (B, 2, H, S, D) or L x 2 x (B, H, S, D)
        if cache is not None:
            return logits, tf.stack(new_caches, axis=1)  # (B, L, 2, H, S, D)
        return logits

    def embed(self, token_ids, start_index=0, positions=None, training=None):
        """The hidden states (B, T, C) the first block reads: the embeddings of
        `token_ids` (B, T), with the learned positions' from `start_index`
        (or explicit `positions` (B, T)) when the model has a position table."""
        return self.embeddings(token_ids, start_index=start_index, positions=positions,
                               training=training)

    def logits(self, x):
        """float32 logits (B, T, V) of the final norm's output `x` (B, T, C): the
        projection onto the vocabulary, the token table's transpose when tied.
        Built in a tensor slice, this slice's V/T ids (`TensorSlice.cross_entropy`
        takes them as they are)."""
        x = self.tensor_slice.copy_to_group(x)  # f: each slice of the vocabulary reads it whole
        if self.lm_head is not None:
            logits = self.lm_head(x)
        else:
            embedding = tf.cast(
                self.embeddings.token_embedding.embeddings, self.compute_dtype
            )  # (V, C)
            # One 2-D matmul: a (B, T, C) x (V, C)^T batch matmul broadcasts
            # the table, and its gradient sums B partial (V, C) gradients.
            batch_size, length = tf.shape(x)[0], tf.shape(x)[1]
            logits = tf.matmul(
                tf.reshape(x, [-1, x.shape[-1]]), embedding, transpose_b=True
            )  # (B*T, V)
            logits = tf.reshape(logits, [batch_size, length, embedding.shape[0]])  # (B, T, V)
        return tf.cast(logits, "float32")

    def generate(self, prompt_ids, max_new_tokens, **options):
        """Returns up to `max_new_tokens` new ids after each prompt.

        Greedy by default; `temperature > 0` samples, optionally with `top_k`
        and `top_p` filters, reproducibly given `seed`. `prompt_ids` is a
        list of lists of ids (rows may differ in length), a RaggedTensor or a
        2-D array with an optional `padding_mask`. A row ends at the first of
        `stop_token_ids`, which is not returned. Uses the key/value cache and
        one compiled decode loop. `options` are the keyword arguments of
        `tfgpt.decoding.generate`, which documents them: `temperature`,
        `top_k`, `top_p`, `seed`, `stop_token_ids`, `padding_mask`,
        `use_cache`, `jit_compile`, `return_logits`.

        Returns:
            list of lists of int, one per prompt (with `return_logits`, also
            the (B, N, V) logits of every step).

        Example:
        >>> model = GPT.from_preset("gpt-demo", num_layers=2)
        >>> len(model.generate([[1, 2, 3]], max_new_tokens=5)[0])
        5
        """
        return decoding.generate(self, prompt_ids, max_new_tokens, **options)

    def empty_cache(self, batch_size, cache_length=None):
        """Returns a zero key/value cache (B, L, 2, KV, S, D) for decoding (KV:
        the key-value heads).

        `batch_size` and `cache_length` may be scalar tensors (inside a
        `tf.function`); `cache_length` defaults to `max_sequence_length`.
        """
        if cache_length is None:
            cache_length = self.max_sequence_length
        config = self.config
        shape = [batch_size, self.num_layers, 2, config.key_value_heads, cache_length,
                 config.key_width]
        return tf.zeros(shape, dtype=self.compute_dtype)
