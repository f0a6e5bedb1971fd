"""Generation: cache oracles, batching, sampling filters, tracing, CLI, errors."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tfgpt import GPT
from tfgpt.decoding import decoder_trace_count, top_k_filter, top_p_filter
from tfgpt.generate import main
from tfgpt.loading import save_model

# Distinct sizes so that no two dimensions can be confused for each other.
VOCAB, LAYERS, HEADS, HIDDEN, INTERMEDIATE, CONTEXT = 37, 3, 3, 12, 20, 16
# Cached and full-forward logits differ by float32 rounding only (~3e-6 on
# logits of magnitude ~10); the bound is on the max abs difference.
ATOL = 1e-4
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]


def tiny_model(seed=0, **overrides):
    """A GPT whose greedy continuations vary with the prompt.

    At the default initialisation (stddev 0.02) every logit is nearly the
    same and greedy decoding repeats one token, which would make "cached
    equals uncached" a weak check. Unit-scale embeddings spread the logits.
    """
    config = dict(
        vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE, max_sequence_length=CONTEXT,
    )
    config.update(overrides)
    model = GPT(**config)
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        if len(weight.shape) == 2:
            embedding = weight.shape[0] in (config["vocabulary_size"], CONTEXT)
            weight.assign(rng.normal(0.0, 1.0 if embedding else 0.3, weight.shape))
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


# ---- Oracles ------------------------------------------------------------------


def test_cached_greedy_equals_uncached_greedy(model):
    cached = model.generate(PROMPTS, 10)
    uncached = model.generate(PROMPTS, 10, use_cache=False)
    assert cached == uncached
    # Not a degenerate model: rows differ and tokens vary within rows.
    assert len({tuple(row) for row in cached}) == len(PROMPTS)
    assert all(len(set(row)) > 1 for row in cached[1:])


def test_cached_logits_equal_the_full_forward_pass(model):
    new_ids, logits = model.generate(PROMPTS, 10, return_logits=True)
    assert logits.shape == (len(PROMPTS), 10, VOCAB)
    for row, (prompt, continuation) in enumerate(zip(PROMPTS, new_ids)):
        full = model(np.array([prompt + continuation])).numpy()[0]  # (T, V)
        expected = full[len(prompt) - 1 : len(prompt) - 1 + 10]
        assert np.abs(logits[row] - expected).max() < ATOL
        # The token chosen at each step is the argmax of those logits.
        assert continuation == np.argmax(expected, axis=-1).tolist()
    _, uncached = model.generate(PROMPTS, 10, return_logits=True, use_cache=False)
    assert np.abs(uncached - logits).max() < ATOL


def test_a_batch_equals_its_rows_one_by_one(model):
    batch = model.generate(PROMPTS, 6, temperature=0.0)
    assert batch == [model.generate([prompt], 6)[0] for prompt in PROMPTS]


def test_prompt_formats_agree(model):
    expected = model.generate(PROMPTS, 4)
    ragged = tf.ragged.constant(PROMPTS)
    assert model.generate(ragged, 4) == expected
    # Left- and right-padded arrays with a mask give the same prompts.
    width = max(len(p) for p in PROMPTS)
    left = np.zeros((3, width), np.int32)
    right = np.zeros((3, width), np.int32)
    for row, prompt in enumerate(PROMPTS):
        left[row, width - len(prompt):] = prompt
        right[row, : len(prompt)] = prompt
    assert model.generate(left, 4, padding_mask=left > 0) == expected
    assert model.generate(right, 4, padding_mask=right > 0) == expected
    full = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    assert model.generate(full, 4) == model.generate(full.tolist(), 4)


def test_prompt_filling_the_context_exactly(model):
    prompt = list(range(1, CONTEXT - 2))
    assert len(model.generate([prompt], 3)[0]) == 3


# ---- Sampling -------------------------------------------------------------------


def test_seed_makes_sampling_reproducible(model):
    options = dict(temperature=1.5, seed=7)
    first = model.generate(PROMPTS, 8, **options)
    assert model.generate(PROMPTS, 8, **options) == first
    others = [model.generate(PROMPTS, 8, temperature=1.5, seed=seed) for seed in (8, 9)]
    assert any(other != first for other in others)
    assert first != model.generate(PROMPTS, 8)  # high temperature leaves greedy


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = model.generate(PROMPTS, 6)
    assert model.generate(PROMPTS, 6, temperature=2.0, top_k=1, seed=1) == greedy
    assert model.generate(PROMPTS, 6, temperature=2.0, top_p=1e-6, seed=1) == greedy


def test_samples_stay_inside_the_top_k(model):
    new_ids, logits = model.generate(
        PROMPTS, 8, temperature=5.0, top_k=3, seed=2, return_logits=True
    )
    for row, continuation in enumerate(new_ids):
        for step, token in enumerate(continuation):
            assert token in np.argsort(-logits[row, step])[:3]


def test_filters_match_numpy():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.7, 0.1, 0.1, 0.1]], np.float32))
    kept = top_k_filter(tf.constant(logits), tf.constant(2)).numpy()
    np.testing.assert_array_equal(np.isfinite(kept), [[0, 1, 0, 1], [1, 1, 1, 1]])
    # Nucleus 0.6: row 0 needs 0.4 + 0.3; row 1 is covered by 0.7 alone.
    kept = top_p_filter(tf.constant(logits), tf.constant(0.6)).numpy()
    np.testing.assert_array_equal(np.isfinite(kept), [[0, 1, 0, 1], [1, 0, 0, 0]])
    np.testing.assert_array_equal(kept[np.isfinite(kept)], logits[np.isfinite(kept)])


def test_stop_tokens_end_rows_and_are_not_returned(model):
    greedy = model.generate(PROMPTS, 10)
    stop = greedy[1][2]
    stopped = model.generate(PROMPTS, 10, stop_token_ids=[stop])
    for row, full in zip(stopped, greedy):
        expected = full[: full.index(stop)] if stop in full else full
        assert row == expected
    assert len(stopped[1]) == greedy[1].index(stop) < 10


# ---- Compilation ------------------------------------------------------------------


def test_second_call_does_not_trace_again():
    model = tiny_model(seed=1)
    model.generate(PROMPTS, 5)
    assert decoder_trace_count(model) == 1
    # Same batch shape; then new lengths, budget and sampling settings.
    model.generate([[9, 8, 7], [6, 5], [4, 3, 2, 1, 2]], 5)
    model.generate([[1], [2, 3]], 7, temperature=0.7, top_k=4, top_p=0.9, seed=3, stop_token_ids=[5])
    assert decoder_trace_count(model) == 1


@pytest.mark.slow
def test_xla_decoding_equals_eager_graph_decoding(model):
    expected = model.generate(PROMPTS, 6)
    assert model.generate(PROMPTS, 6, jit_compile=True) == expected
    # A prompt length in the same bucket of 16 reuses the compilation.
    assert model.generate([p[:-1] or p for p in PROMPTS], 6, jit_compile=True)
    assert decoder_trace_count(model, jit_compile=True) == 1


# ---- CLI --------------------------------------------------------------------------


def test_cli_prints_text_and_rate(tmp_path, capsys):
    from pipelines.tokenizer import train_tokenizer

    documents = [f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60)]
    tokenizer = train_tokenizer(documents, 300, str(tmp_path / "t.model"), num_threads=1)
    model = tiny_model(seed=2, vocabulary_size=tokenizer.vocabulary_size, max_sequence_length=40)
    save_model(str(tmp_path / "run"), model, tokenizer)
    prompt = "the quick brown fox"
    main(["--checkpoint", str(tmp_path / "run"), "--prompt", prompt, "--max-new-tokens", "12"])
    captured = capsys.readouterr()
    prompt_ids = tokenizer.encode(prompt)
    new_ids = model.generate([prompt_ids], 12, stop_token_ids=[tokenizer.eos_id])[0]
    assert captured.out == tokenizer.decode(prompt_ids + new_ids) + "\n"
    assert "tokens/s" in captured.err
    main([
        "--checkpoint", str(tmp_path / "run"), "--prompt", prompt, "--prompt", "jumps",
        "--max-new-tokens", "5", "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9",
        "--seed", "1",
    ])
    assert capsys.readouterr().out.count("\n") >= 3


# ---- Bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        (PROMPTS, dict(max_new_tokens=12), r"overflow.*max_new_tokens=12.*prompt of 5 tokens.*max_sequence_length=16.*at most 11"),
        (PROMPTS, dict(max_new_tokens=0), r"max_new_tokens=0"),
        (PROMPTS, dict(max_new_tokens=3, temperature=-0.5), r"temperature=-0.5"),
        (PROMPTS, dict(max_new_tokens=3, top_k=-1), r"top_k=-1"),
        (PROMPTS, dict(max_new_tokens=3, top_p=0.0), r"top_p=0.0"),
        (PROMPTS, dict(max_new_tokens=3, top_p=1.5), r"top_p=1.5"),
        ([[1, 2], []], dict(max_new_tokens=3), r"prompt 1 is empty"),
        ([[1, 37]], dict(max_new_tokens=3), r"id 37 in prompt 0, vocabulary_size=37"),
        ([[1, -1]], dict(max_new_tokens=3), r"id -1 in prompt 0"),
        ([1, 2, 3], dict(max_new_tokens=3), r"prompt_ids\[0\]=1"),
        ([], dict(max_new_tokens=3), r"`prompt_ids` is empty"),
        (PROMPTS, dict(max_new_tokens=3, stop_token_ids=[40]), r"stop_token_ids containing 40"),
        (PROMPTS, dict(max_new_tokens=3, use_cache=False, jit_compile=True), r"jit_compile=True, use_cache=False"),
    ],
)
def test_bad_generation_arguments_raise(model, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(prompts, **kwargs)


def test_cli_without_tokenizer_raises(tmp_path):
    save_model(str(tmp_path), tiny_model())
    assert json.loads((tmp_path / "config.json").read_text())["model"]["vocabulary_size"] == VOCAB
    with pytest.raises(ValueError, match="No tokenizer"):
        main(["--checkpoint", str(tmp_path), "--prompt", "hi"])


def test_every_cache_form_gives_the_same_logits(model):
    ids = np.array([[3, 1, 4, 1, 5, 9, 2]])
    full = model(ids).numpy()
    stacked = model.empty_cache(1, cache_length=9)  # (B, L, 2, H, S, D)
    forms = {
        "stacked": stacked,
        "per-layer": [stacked[:, index] for index in range(LAYERS)],
        "per-layer pairs": [(stacked[:, i, 0], stacked[:, i, 1]) for i in range(LAYERS)],
    }
    for name, cache in forms.items():
        logits, cache = model(ids[:, :4], cache=cache, cache_index=0)
        steps = [logits.numpy()]
        for index in range(4, 7):
            logits, cache = model(ids[:, index : index + 1], cache=cache, cache_index=index)
            steps.append(logits.numpy())
        assert np.abs(np.concatenate(steps, axis=1) - full).max() < ATOL, name
        assert type(cache) is type(forms[name])


def test_chat_conversations_take_the_system_turn_the_history_and_each_prompt(tmp_path):
    from tfgpt import generate

    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "turns.json").write_text(json.dumps(history))
    args = generate.parse_args(["--checkpoint", "x", "--chat", "--system", "Be brief.",
                                "--messages", str(tmp_path / "turns.json"), "--prompt", "a",
                                "--prompt", "b"])
    system = [{"role": "system", "content": "Be brief."}]
    assert generate.conversations(args) == [
        system + history + [{"role": "user", "content": "a"}],
        system + history + [{"role": "user", "content": "b"}]]
    # The history alone, continued by the model's reply.
    args = generate.parse_args(["--checkpoint", "x", "--chat", "--messages",
                                str(tmp_path / "turns.json")])
    assert generate.conversations(args) == [history]
    (tmp_path / "bad.json").write_text(json.dumps([{"role": "bot", "content": "?"}]))
    args = generate.parse_args(["--checkpoint", "x", "--chat", "--messages",
                                str(tmp_path / "bad.json")])
    with pytest.raises(ValueError, match=r'bad.json: expected a JSON list of \{"role", '
                                         r'"content"\} with roles system, user, assistant'):
        generate.conversations(args)
    for flags in (["--system", "s", "--prompt", "p"], ["--chat"]):
        with pytest.raises(SystemExit):
            generate.parse_args(["--checkpoint", "x", *flags])
