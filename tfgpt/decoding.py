"""Autoregressive generation for GPT with a key/value cache.

`generate(model, prompt_ids, max_new_tokens, ...)` (also `GPT.generate`)
returns the new ids of each prompt. Decoding is greedy by default
(`temperature=0`); a positive temperature samples, optionally restricted to
the `top_k` most likely tokens and to the nucleus of probability `top_p`
(Holtzman et al. 2020). Sampling is reproducible with `seed`.

How it runs:
- Prompts of different lengths are left-padded to the longest, with a
  padding mask over the cache and per-row positions, so every row's next
  token sits in the last column.
- The prompt fills the cache in one forward pass; each new token then costs
  one position (`cache_index`), not the whole prefix.
- The whole loop (prefill, sampling, stop tokens) is one `tf.function` with
  a fully dynamic input signature, traced once per model and per
  (`use_cache`, `jit_compile`, `return_logits`): a new batch size, prompt
  length, `max_new_tokens`, temperature, top-k, top-p, seed or stop list
  does not trace again. With `jit_compile=True` XLA compiles the loop once
  per distinct (batch size, padded prompt length, `max_new_tokens`,
  `top_k`), the values XLA needs as constants; prompt lengths are padded up
  to a multiple of 16 so that nearby lengths share a compilation. On CPU the
  XLA loop is several times faster per token (see bench/generation.py) and
  its first call costs about as much as tracing the graph-mode loop.
"""

import random

import numpy as np
import tensorflow as tf

from tfgpt.config.checks import require_int_at_least
from tfgpt.graph_function import graph_function

# Prompt lengths are padded up to a multiple of this under XLA, whose
# compilations are per shape.
XLA_LENGTH_BUCKET = 16

# What the integer arguments accept: Python's ints and NumPy's.
_INTEGERS = (int, np.integer)


def generate(
    model,
    prompt_ids,
    max_new_tokens,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed=None,
    stop_token_ids=None,
    padding_mask=None,
    use_cache=True,
    jit_compile=False,
    return_logits=False,
):
    """Generates up to `max_new_tokens` ids after each prompt.

    Args:
        model: a `tfgpt.GPT`.
        prompt_ids: the prompts, one of: a list of lists of int (rows may
            differ in length), a `tf.RaggedTensor`, or a 2-D int array or
            tensor (B, T) whose rows are all real tokens unless
            `padding_mask` says otherwise.
        max_new_tokens: int >= 1. The longest prompt plus `max_new_tokens`
            must fit in `model.max_sequence_length`.
        temperature: float >= 0. 0 picks the most likely token (greedy);
            otherwise logits are divided by it and a token is sampled.
        top_k: int >= 0. Sample among the `top_k` most likely tokens only; 0
            turns the filter off. Ignored when greedy.
        top_p: float in (0, 1]. Sample from the smallest set of tokens whose
            probability adds up to `top_p`; 1 turns the filter off. Ignored
            when greedy.
        seed: optional int. The same seed, batch of prompts and settings give
            the same ids (a row's sample depends on the whole batch, not on
            its prompt alone); None draws a fresh seed.
        stop_token_ids: optional int or iterable of int. A row ends at the
            first of these it generates; the stop token is not returned.
        padding_mask: optional (B, T) array marking the real tokens of a 2-D
            `prompt_ids`, left- or right-padded.
        use_cache: bool. Decode with the key/value cache (the fast path);
            False recomputes the whole prefix for every token (the reference
            the tests and the benchmark compare against).
        jit_compile: bool. Compile the decode loop with XLA (cached path only).
        return_logits: bool. Also return the float32 logits (B, N, V) each
            token was chosen from (before temperature and filters). Rows
            that stopped early keep running, so all N steps are filled.

    Returns:
        list of lists of int: the new ids of each prompt, at most
        `max_new_tokens` each, shorter where a stop token came first; with
        `return_logits`, the pair `(new_ids, logits)`.

    Example:
    >>> model = GPT.from_preset("gpt-demo", num_layers=2)
    >>> new_ids = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4)
    >>> [len(row) for row in new_ids]
    [4, 4]
    """
    prompts = _prompt_rows(prompt_ids, padding_mask)
    validate_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, seed)
    if jit_compile and not use_cache:
        raise ValueError(
            "`jit_compile=True` needs the cache: the uncached reference path "
            "grows its input every step. Received: jit_compile=True, use_cache=False"
        )
    stop_token_ids = _stop_ids(model, stop_token_ids)
    bucket = XLA_LENGTH_BUCKET if jit_compile else 1
    token_ids, prompt_lengths = left_pad(prompts, bucket)
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    seed = int(seed) % 2**31  # the stateless ops take int32 seeds
    decoder = _decoder(model, use_cache, jit_compile, return_logits)
    outputs = decoder(
        tf.constant(token_ids),
        tf.constant(prompt_lengths),
        tf.constant(max_new_tokens, tf.int32),
        tf.constant(temperature, tf.float32),
        tf.constant(min(top_k, model.vocabulary_size), tf.int32),
        tf.constant(top_p, tf.float32),
        tf.constant([seed, 0], tf.int32),
        tf.constant(stop_token_ids, tf.int32, shape=[len(stop_token_ids)]),
    )
    generated, lengths = outputs[0].numpy(), outputs[1].numpy()
    new_ids = [row[:length].tolist() for row, length in zip(generated, lengths)]
    if return_logits:
        return new_ids, outputs[2].numpy()
    return new_ids


def decoder_trace_count(model, use_cache=True, jit_compile=False, return_logits=False):
    """Returns how many times the decode loop of `model` was traced (0 if never)."""
    function = _decoders(model).get((use_cache, jit_compile, return_logits))
    return 0 if function is None else function.experimental_get_tracing_count()


def left_pad(prompts, multiple=1):
    """Left-pads lists of ids with 0 to a common length (a multiple of `multiple`).

    Returns `(token_ids (B, P) int32, prompt_lengths (B,) int32)`.
    """
    longest = max(len(row) for row in prompts)
    width = -(-longest // multiple) * multiple
    token_ids = np.zeros((len(prompts), width), np.int32)
    for index, row in enumerate(prompts):
        token_ids[index, width - len(row) :] = row
    return token_ids, np.array([len(row) for row in prompts], np.int32)


def decode(
    model,
    token_ids,
    prompt_lengths,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    stop_token_ids,
    use_cache=True,
    return_logits=False,
):
    """The decode loop in TensorFlow ops, for use inside a `tf.function`.

    Args:
        model: a `tfgpt.GPT`.
        token_ids: int32 (B, P). Prompts, left-padded.
        prompt_lengths: int32 (B,). Real tokens per row (>= 1).
        max_new_tokens: int32 scalar N.
        temperature, top_k, top_p: scalars as in `generate` (top_k <= V).
        seed: int32 (2,). Stateless sampling seed.
        stop_token_ids: int32 (K,), possibly empty.
        use_cache: Python bool.
        return_logits: Python bool. Also return the logits of every step.

    Returns:
        `(generated, lengths)`: int32 (B, N) with each row's new ids, its stop
        token if any, then -1; and int32 (B,) counting the ids before the
        stop token. With `return_logits`, also float32 (B, N, V) logits
        (steps after a row's stop token hold what the model computed there).
    """
    batch_size = tf.shape(token_ids)[0]
    prompt_width = tf.shape(token_ids)[1]
    total = prompt_width + max_new_tokens
    padding = prompt_width - prompt_lengths  # (B,)
    columns = tf.range(total)  # (S,)
    # Keys are real from each row's first prompt token on; later columns are
    # written before they are read, and the causal mask hides the rest.
    key_mask = columns[tf.newaxis, :] >= padding[:, tf.newaxis]  # (B, S)
    positions = tf.maximum(columns[tf.newaxis, :] - padding[:, tf.newaxis], 0)  # (B, S)
    new_columns = tf.range(max_new_tokens)[tf.newaxis, :]  # (1, N)

    if use_cache:
        # One (key, value) pair per layer: each step updates them in place
        # (under XLA) instead of re-stacking a (B, L, 2, KV, S, D) tensor.
        config = model.config
        empty = tf.zeros([batch_size, config.key_value_heads, total, config.key_width],
                         model.compute_dtype)
        cache = [(empty, empty) for _ in range(model.num_layers)]
        logits, cache = model(
            token_ids,
            padding_mask=key_mask,
            cache=cache,
            cache_index=0,
            positions=positions[:, :prompt_width],
        )  # (B, P, V)
        state = cache
    else:
        sequence = tf.concat(
            [token_ids, tf.zeros([batch_size, max_new_tokens], tf.int32)], axis=1
        )  # (B, S)
        logits = model(
            token_ids,
            padding_mask=key_mask[:, :prompt_width],
            positions=positions[:, :prompt_width],
        )  # (B, P, V)
        state = sequence
    next_logits = logits[:, -1, :]  # (B, V)

    def next_token(step, logits):
        token = sample(logits, temperature, top_k, top_p, tf.random.experimental.stateless_fold_in(seed, step))
        return tf.cast(token, tf.int32)  # (B,)

    def record(step, token, generated, done, lengths):
        generated = tf.where(
            (new_columns == step) & ~done[:, tf.newaxis], token[:, tf.newaxis], generated
        )  # (B, N)
        stopped = tf.reduce_any(token[:, tf.newaxis] == stop_token_ids[tf.newaxis, :], axis=1)
        lengths = lengths + tf.cast(~done & ~stopped, tf.int32)
        return generated, done | stopped, lengths

    generated = tf.fill([batch_size, max_new_tokens], -1)  # (B, N)
    done = tf.zeros([batch_size], tf.bool)
    lengths = tf.zeros([batch_size], tf.int32)
    token = next_token(0, next_logits)
    generated, done, lengths = record(0, token, generated, done, lengths)
    # Logits per step, only when asked: (N, B, V) floats would dominate the
    # loop's memory traffic for a large vocabulary.
    history = tf.TensorArray(tf.float32, size=max_new_tokens if return_logits else 1)
    history = history.write(0, next_logits) if return_logits else history

    def keep_going(step, token, state, generated, done, lengths, history):
        if return_logits:  # every step's logits are filled in
            return step < max_new_tokens
        return (step < max_new_tokens) & ~tf.reduce_all(done)

    def body(step, token, state, generated, done, lengths, history):
        column = prompt_width + step - 1  # where the previous token goes
        if use_cache:
            logits, state = model(
                token[:, tf.newaxis],
                padding_mask=key_mask,
                cache=state,
                cache_index=column,
                # tf.slice keeps the size static (1); XLA reads
                # positions[:, column : column + 1] as a dynamic-size slice.
                positions=tf.slice(positions, [0, column], [-1, 1]),  # (B, 1)
            )  # (B, 1, V)
        else:
            state = tf.where(columns[tf.newaxis, :] == column, token[:, tf.newaxis], state)
            logits = model(
                state[:, : column + 1],
                padding_mask=key_mask[:, : column + 1],
                positions=positions[:, : column + 1],
            )  # (B, column + 1, V)
        token = next_token(step, logits[:, -1, :])
        generated, done, lengths = record(step, token, generated, done, lengths)
        if return_logits:
            history = history.write(step, logits[:, -1, :])
        return step + 1, token, state, generated, done, lengths, history

    _, _, _, generated, _, lengths, history = tf.while_loop(
        keep_going,
        body,
        (tf.constant(1), token, state, generated, done, lengths, history),
    )
    if return_logits:
        history = history.stack()  # (N, B, V)
        return generated, lengths, tf.transpose(history, [1, 0, 2])  # (B, N, V)
    return generated, lengths


def sample(logits, temperature, top_k, top_p, seed):
    """Picks one token per row of `logits` (B, V); see `generate` for the knobs."""

    def greedy():
        return tf.argmax(logits, axis=-1, output_type=tf.int32)

    def stochastic():
        scaled = logits / temperature
        scaled = tf.cond(top_k > 0, lambda: top_k_filter(scaled, top_k), lambda: scaled)
        scaled = tf.cond(top_p < 1.0, lambda: top_p_filter(scaled, top_p), lambda: scaled)
        return tf.random.stateless_categorical(scaled, 1, seed, dtype=tf.int32)[:, 0]

    return tf.cond(temperature > 0.0, stochastic, greedy)


def top_k_filter(logits, k):
    """Sets every logit below the k-th largest of its row to -inf (ties kept)."""
    # At least 1: XLA compiles the branch that skips this filter too (k=0).
    threshold = tf.math.top_k(logits, tf.maximum(k, 1)).values[:, -1:]  # (B, 1)
    return tf.where(logits < threshold, -np.inf, logits)


def top_p_filter(logits, p):
    """Keeps each row's smallest set of most likely tokens with probability >= p."""
    ordered = tf.sort(logits, axis=-1, direction="DESCENDING")  # (B, V)
    # Probability mass strictly before each token: the first always stays.
    before = tf.math.cumsum(tf.nn.softmax(ordered, axis=-1), axis=-1, exclusive=True)
    threshold = tf.reduce_min(tf.where(before < p, ordered, np.inf), axis=-1, keepdims=True)
    return tf.where(logits < threshold, -np.inf, logits)


# ---- helpers ---------------------------------------------------------------


def _decoders(model):
    # A plain dict outside Keras' attribute tracking, so that saving the
    # model (.keras, SavedModel, checkpoints) never sees these functions.
    decoders = model.__dict__.get("_tfgpt_decoders")
    if decoders is None:
        decoders = {}
        object.__setattr__(model, "_tfgpt_decoders", decoders)
    return decoders


def _decoder(model, use_cache, jit_compile, return_logits=False):
    decoders = _decoders(model)
    key = (use_cache, jit_compile, return_logits)
    if key not in decoders:

        def run(token_ids, prompt_lengths, max_new_tokens, temperature, top_k, top_p, seed, stops):
            return decode(
                model, token_ids, prompt_lengths, max_new_tokens, temperature,
                top_k, top_p, seed, stops, use_cache=use_cache,
                return_logits=return_logits,
            )

        decoders[key] = graph_function(
            run,
            input_signature=[
                tf.TensorSpec([None, None], tf.int32, name="token_ids"),
                tf.TensorSpec([None], tf.int32, name="prompt_lengths"),
                tf.TensorSpec([], tf.int32, name="max_new_tokens"),
                tf.TensorSpec([], tf.float32, name="temperature"),
                tf.TensorSpec([], tf.int32, name="top_k"),
                tf.TensorSpec([], tf.float32, name="top_p"),
                tf.TensorSpec([2], tf.int32, name="seed"),
                tf.TensorSpec([None], tf.int32, name="stop_token_ids"),
            ],
            jit_compile=jit_compile,
        )
    return decoders[key]


def _prompt_rows(prompt_ids, padding_mask):
    """Returns the prompts as a list of lists of int."""
    if isinstance(prompt_ids, tf.RaggedTensor):
        if padding_mask is not None:
            raise ValueError("`padding_mask` is for 2-D prompts, not a RaggedTensor")
        return prompt_ids.to_list()
    if isinstance(prompt_ids, (tf.Tensor, np.ndarray)):
        array = np.asarray(prompt_ids)
        if array.ndim != 2:
            raise ValueError(
                "A prompt array must be 2-D (batch, length). Received: "
                f"prompt_ids of shape {array.shape}"
            )
        if padding_mask is None:
            return array.tolist()
        mask = np.asarray(padding_mask).astype(bool)
        if mask.shape != array.shape:
            raise ValueError(
                "`padding_mask` must have the shape of `prompt_ids`. Received: "
                f"padding_mask shape {mask.shape}, prompt_ids shape {array.shape}"
            )
        return [row[keep].tolist() for row, keep in zip(array, mask)]
    if padding_mask is not None:
        raise ValueError("`padding_mask` is for 2-D prompt arrays, not lists")
    rows = list(prompt_ids)
    for index, row in enumerate(rows):
        if isinstance(row, (int, np.integer, str, bytes)):
            raise ValueError(
                "`prompt_ids` must be a batch: a list of lists of ids. Received: "
                f"prompt_ids[{index}]={row!r}"
            )
    return [list(row) for row in rows]


def validate_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, seed):
    """Raises ValueError naming the first argument of `generate` out of range."""
    if not prompts:
        raise ValueError("`prompt_ids` is empty: give at least one prompt")
    for index, row in enumerate(prompts):
        if not row:
            raise ValueError(
                f"Every prompt needs at least one token. Received: prompt {index} is empty"
            )
        for value in row:
            if isinstance(value, bool) or not isinstance(value, _INTEGERS):
                raise ValueError(
                    f"Token ids must be integers. Received: {value!r} in prompt {index}"
                )
            if not 0 <= value < model.vocabulary_size:
                raise ValueError(
                    "Token id outside the vocabulary. Received: "
                    f"id {value} in prompt {index}, vocabulary_size={model.vocabulary_size}"
                )
    require_int_at_least("max_new_tokens", max_new_tokens, 1, "a positive integer", _INTEGERS)
    longest = max(len(row) for row in prompts)
    if longest + max_new_tokens > model.max_sequence_length:
        raise ValueError(
            "The prompt plus the new tokens overflow the context. Received: "
            f"max_new_tokens={max_new_tokens} after a prompt of {longest} tokens, "
            f"max_sequence_length={model.max_sequence_length} (at most "
            f"{model.max_sequence_length - longest} new tokens fit)"
        )
    if not isinstance(temperature, (int, float, np.number)) or not temperature >= 0:
        raise ValueError(
            "`temperature` must be a number >= 0 (0 is greedy). "
            f"Received: temperature={temperature!r}"
        )
    require_int_at_least("top_k", top_k, 0, "an integer >= 0 (0 is off)", _INTEGERS)
    if not isinstance(top_p, (int, float, np.number)) or not 0 < top_p <= 1:
        raise ValueError(f"`top_p` must be in (0, 1] (1 is off). Received: top_p={top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, _INTEGERS)):
        raise ValueError(f"`seed` must be an integer or None. Received: seed={seed!r}")


def _stop_ids(model, stop_token_ids):
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, _INTEGERS):
        stop_token_ids = [stop_token_ids]
    stop_token_ids = [int(value) for value in stop_token_ids]
    for value in stop_token_ids:
        if not 0 <= value < model.vocabulary_size:
            raise ValueError(
                "Stop token outside the vocabulary. Received: "
                f"stop_token_ids containing {value}, vocabulary_size={model.vocabulary_size}"
            )
    return stop_token_ids
