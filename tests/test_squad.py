"""SQuAD: reading and answer checks, windowed features, post-processing, official metrics."""

import json
import re

import numpy as np
import pytest

from tfgpt.finetuning.squad import (
    SquadExample,
    gold_answers,
    postprocess_predictions,
    read_squad,
    squad_features,
)
from tfgpt.finetuning.squad_metrics import (
    exact_match_score,
    f1_score,
    normalize_answer,
    squad_scores,
)


class WordTokenizer:
    """Words and single punctuation marks, with character offsets (test stand-in)."""

    pad_id, cls_id, sep_id = 0, 1, 2

    def __init__(self):
        self.vocabulary = {}

    def encode_with_offsets(self, text):
        ids, offsets = [], []
        for match in re.finditer(r"\w+|[^\w\s]", text):
            word = match.group().lower()
            ids.append(self.vocabulary.setdefault(word, len(self.vocabulary) + 3))
            offsets.append(match.span())
        return ids, offsets


CONTEXT = "Super Bowl 50 was won by the Denver Broncos, who beat the Carolina Panthers."


def squad_file(tmp_path, questions, version="1.1", context=CONTEXT):
    data = {
        "version": version,
        "data": [{"title": "t", "paragraphs": [{"context": context, "qas": questions}]}],
    }
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(data))
    return str(path)


def answer(text, context=CONTEXT):
    return {"text": text, "answer_start": context.index(text)}


# ---- Reading --------------------------------------------------------------


def test_read_squad_v1_1(tmp_path):
    path = squad_file(
        tmp_path,
        [
            {"id": "q1", "question": "Who won?", "answers": [answer("Denver Broncos")] * 2},
            {"id": "q2", "question": "Who lost?", "answers": [answer("Carolina Panthers")]},
        ],
    )
    version, examples = read_squad(path)
    assert version == "1.1"
    assert [example.question_id for example in examples] == ["q1", "q2"]
    assert examples[0].answers == (("Denver Broncos", 29),) * 2
    assert not examples[0].is_impossible


def test_read_squad_v2_0_unanswerable(tmp_path):
    path = squad_file(
        tmp_path,
        [
            {"id": "q1", "question": "Who won?", "answers": [answer("Denver Broncos")],
             "is_impossible": False},
            {"id": "q2", "question": "Who sang?", "answers": [], "is_impossible": True,
             "plausible_answers": [answer("Carolina Panthers")]},
        ],
        version="v2.0",  # As the official train-v2.0.json and dev-v2.0.json say.
    )
    version, examples = read_squad(path)
    assert version == "2.0"
    assert examples[1].is_impossible and examples[1].answers == ()
    assert gold_answers(examples) == {"q1": ["Denver Broncos"], "q2": []}


@pytest.mark.parametrize(
    "question, message",
    [
        (
            {"id": "q7", "question": "Who won?",
             "answers": [{"text": "Denver Broncos", "answer_start": 28}]},
            r"question 'q7': answer text 'Denver Broncos' does not match its context at "
            r"answer_start=28 \(the context has ' Denver Bronco' there\)",
        ),
        (
            {"id": "q8", "question": "Who won?",
             "answers": [{"text": "Broncos", "answer_start": 500}]},
            r"question 'q8'.*answer_start=500",
        ),
        (
            {"id": "q9", "question": "Who won?", "answers": [answer("Denver Broncos")],
             "is_impossible": True},
            r"question 'q9' is marked is_impossible but has 1 answer",
        ),
        ({"id": "q10", "question": "Who won?", "answers": []}, r"question 'q10' has no answers"),
        (
            {"id": "q11", "question": "Who won?", "answers": [{"text": "Denver"}]},
            r"question 'q11'.*answer_start=None",
        ),
    ],
    ids=["shifted", "out-of-range", "impossible-with-answer", "no-answer", "no-start"],
)
def test_bad_answers_raise_naming_the_question(tmp_path, question, message):
    with pytest.raises(ValueError, match=message):
        read_squad(squad_file(tmp_path, [question]))


def test_repeated_id_and_malformed_files_raise(tmp_path):
    question = {"id": "q1", "question": "Who won?", "answers": [answer("Denver Broncos")]}
    with pytest.raises(ValueError, match=r"'q1' appears more than once"):
        read_squad(squad_file(tmp_path, [question, question]))
    broken = tmp_path / "broken.json"
    broken.write_text('{"data": [')
    with pytest.raises(ValueError, match=r"broken\.json: malformed JSON"):
        read_squad(str(broken))
    with pytest.raises(ValueError, match=r"not a SQuAD file"):
        broken.write_text("[]")
        read_squad(str(broken))


# ---- Features -------------------------------------------------------------

# Ten one-letter tokens; "e f" are tokens 4 and 5.
LETTERS = "a b c d e f g h i j"


def letters_example(answer_text="e f", question="q"):
    return SquadExample(
        question_id="letters",
        question=question,
        context=LETTERS,
        answers=((answer_text, LETTERS.index(answer_text)),),
    )


def letters_features(tokenizer=None):
    # T = 8 leaves 8 - 1 (question) - 3 (specials) = 4 context tokens per
    # window; starts 2 apart: tokens [0-3], [2-5], [4-7], [6-9].
    return squad_features(
        [letters_example()],
        tokenizer or WordTokenizer(),
        max_sequence_length=8,
        stride=2,
        max_question_length=1,
    )


def test_long_context_is_split_into_overlapping_windows():
    tokenizer = WordTokenizer()
    features = letters_features(tokenizer)
    assert features.token_ids.shape == (4, 8)
    q = tokenizer.vocabulary["q"]
    letter = {c: tokenizer.vocabulary[c] for c in "abcdefghij"}
    np.testing.assert_array_equal(
        features.token_ids[1], [1, q, 2, letter["c"], letter["d"], letter["e"], letter["f"], 2]
    )
    np.testing.assert_array_equal(features.segment_ids[1], [0, 0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(features.padding_mask[1], [1] * 8)
    # The answer (tokens 4-5) lies wholly in windows 1 and 2 only; context
    # starts at position 3 (after [CLS] q [SEP]).
    np.testing.assert_array_equal(features.start_positions, [0, 3 + 2, 3 + 0, 0])
    np.testing.assert_array_equal(features.end_positions, [0, 3 + 3, 3 + 1, 0])
    np.testing.assert_array_equal(features.example_index, [0, 0, 0, 0])
    # Character offsets of context tokens, -1 elsewhere.
    np.testing.assert_array_equal(features.token_offsets[1, 3], [4, 5])  # "c"
    np.testing.assert_array_equal(features.token_offsets[1, :3], -1)
    np.testing.assert_array_equal(features.token_offsets[1, 7], [-1, -1])
    # Token 4 ("e") has min(2, 1) context in window 1 and min(0, 3) in
    # window 2, so window 1 owns it; token 5 ("f") is owned by window 2.
    assert features.is_max_context[1, 5] and not features.is_max_context[2, 3]
    assert features.is_max_context[2, 4] and not features.is_max_context[1, 6]
    # Every context token is owned by exactly one window.
    owned = [
        (features.token_offsets[row, position, 0], row)
        for row, position in zip(*np.nonzero(features.is_max_context))
    ]
    assert sorted(start for start, _ in owned) == [LETTERS.index(c) for c in "abcdefghij"]


def test_short_context_is_one_padded_window():
    tokenizer = WordTokenizer()
    example = SquadExample("short", "Who won?", CONTEXT, (("Denver Broncos", 29),))
    features = squad_features(
        [example], tokenizer, max_sequence_length=32, stride=8, max_question_length=8
    )
    # [CLS] who won ? [SEP] + 16 context tokens + [SEP] = 22, then padding.
    assert features.token_ids.shape == (1, 32)
    np.testing.assert_array_equal(features.padding_mask[0], [1] * 22 + [0] * 10)
    np.testing.assert_array_equal(features.token_ids[0, 22:], 0)
    start, end = features.start_positions[0], features.end_positions[0]
    offsets = features.token_offsets[0]
    assert CONTEXT[offsets[start, 0] : offsets[end, 1]] == "Denver Broncos"


def test_unanswerable_question_points_at_cls():
    example = SquadExample("none", "Who sang?", CONTEXT, (), is_impossible=True)
    features = squad_features(
        [example], WordTokenizer(), max_sequence_length=32, stride=8, max_question_length=8
    )
    assert features.start_positions.tolist() == [0] and features.end_positions.tolist() == [0]


def test_bad_feature_sizes_raise():
    with pytest.raises(ValueError, match=r"max_sequence_length=8, max_question_length=64"):
        squad_features([letters_example()], WordTokenizer(), max_sequence_length=8)
    with pytest.raises(ValueError, match=r"stride=5, max_sequence_length=8, max_question_length=1"):
        squad_features(
            [letters_example()],
            WordTokenizer(),
            max_sequence_length=8,
            stride=5,
            max_question_length=1,
        )
    with pytest.raises(ValueError, match=r"'letters': answer ' ' .* covers no token"):
        squad_features(
            [SquadExample("letters", "q", LETTERS, ((" ", 1),))],
            WordTokenizer(),
            max_sequence_length=8,
            stride=2,
            max_question_length=1,
        )


# ---- Post-processing --------------------------------------------------------


def logits_pointing_at(features, starts, ends, value=10.0):
    """Start/end logits of -10 except `value` at the given (row, position) pairs."""
    start_logits = np.full(features.token_ids.shape, -10.0, np.float32)
    end_logits = np.full(features.token_ids.shape, -10.0, np.float32)
    for row, position in starts:
        start_logits[row, position] = value
    for row, position in ends:
        end_logits[row, position] = value
    return start_logits, end_logits


def test_postprocess_maps_the_best_span_back_to_context_text():
    examples = [letters_example()]
    features = letters_features()
    # "e" (window 1, position 5) to "f" (window 1, position 6).
    start_logits, end_logits = logits_pointing_at(features, [(1, 5)], [(1, 6)])
    assert postprocess_predictions(examples, features, start_logits, end_logits) == {
        "letters": "e f"
    }
    # A start in a window that does not own the token is ignored: "e" in
    # window 2 (position 3) is owned by window 1, so the next best start wins.
    start_logits, end_logits = logits_pointing_at(features, [(2, 3)], [(2, 4)])
    start_logits[2, 5] = 5.0  # "g", owned by window 2
    end_logits[2, 5] = 4.0
    assert postprocess_predictions(examples, features, start_logits, end_logits) == {
        "letters": "g"
    }


def test_postprocess_respects_span_order_and_length():
    examples = [letters_example()]
    features = letters_features()
    # Window 0 holds "a b c d" at positions 3-6. The top end "a" lies before
    # the top start "b", so the best valid pair is "b" .. "c" (10 + 1).
    start_logits, end_logits = logits_pointing_at(features, [(0, 4)], [(0, 3)])
    end_logits[0, 5] = 1.0
    assert postprocess_predictions(examples, features, start_logits, end_logits) == {
        "letters": "b c"
    }
    # "a" .. "c" is 3 tokens: too long for max_answer_length=2, so the
    # weaker "a" .. "b" (10 + 5) wins.
    start_logits, end_logits = logits_pointing_at(features, [(0, 3)], [(0, 5)])
    end_logits[0, 4] = 5.0
    assert postprocess_predictions(examples, features, start_logits, end_logits) == {
        "letters": "a b c"
    }
    assert postprocess_predictions(
        examples, features, start_logits, end_logits, max_answer_length=2
    ) == {"letters": "a b"}


def test_postprocess_v2_predicts_no_answer_when_null_scores_best():
    examples = [letters_example()]
    features = letters_features()
    start_logits, end_logits = logits_pointing_at(features, [(1, 5)], [(1, 6)], value=3.0)
    start_logits[:, 0] = end_logits[:, 0] = 4.0  # null score 8 > span score 6
    assert postprocess_predictions(
        examples, features, start_logits, end_logits, allow_no_answer=True
    ) == {"letters": ""}
    # A threshold above the margin (2) keeps the span.
    assert postprocess_predictions(
        examples, features, start_logits, end_logits, allow_no_answer=True, no_answer_threshold=2.5
    ) == {"letters": "e f"}
    # Without allow_no_answer (v1.1), the span is always chosen.
    assert postprocess_predictions(examples, features, start_logits, end_logits) == {
        "letters": "e f"
    }


def test_gold_labels_round_trip_to_exact_match_100(tmp_path):
    path = squad_file(
        tmp_path,
        [
            {"id": "q1", "question": "Who won?", "answers": [answer("Denver Broncos")]},
            {"id": "q2", "question": "Who lost?", "answers": [answer("Carolina Panthers")]},
            {"id": "q3", "question": "Which game?", "answers": [answer("Super Bowl 50")]},
        ],
    )
    version, examples = read_squad(path)
    features = squad_features(
        examples, WordTokenizer(), max_sequence_length=16, stride=3, max_question_length=5
    )
    assert len(features.token_ids) > len(examples)  # Long contexts were split.
    labeled = np.nonzero(features.start_positions)[0]
    start_logits, end_logits = logits_pointing_at(
        features,
        zip(labeled, features.start_positions[labeled]),
        zip(labeled, features.end_positions[labeled]),
    )
    predictions = postprocess_predictions(examples, features, start_logits, end_logits)
    scores = squad_scores(gold_answers(examples), predictions, version)
    assert scores == {"exact_match": 100.0, "f1": 100.0, "total": 3, "missing": 0}


def test_postprocess_checks_logit_shapes():
    examples = [letters_example()]
    features = letters_features()
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(4, 7\)"):
        postprocess_predictions(examples, features, np.zeros((4, 7)), np.zeros((4, 8)))


# ---- Metrics, worked by hand ----------------------------------------------------


@pytest.mark.parametrize(
    "text, normalized",
    [
        ("The  Quick, brown fox!", "quick brown fox"),
        ("an apple a day", "apple day"),
        ("U.S. Army's", "us armys"),
        ("Theatre, then a 'theory'", "theatre then theory"),  # "the" only as a word
        ("  A  ", ""),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


@pytest.mark.parametrize(
    "prediction, gold, exact, f1",
    [
        ("the Denver Broncos.", "Denver Broncos", 1, 1.0),
        # P = 2/3, R = 2/2: F1 = 2 * (2/3) * 1 / (2/3 + 1) = 0.8
        ("the Denver Broncos team", "Denver Broncos", 0, 0.8),
        # Bags of words: order does not matter.
        ("Broncos Denver", "Denver Broncos", 0, 1.0),
        # Counts are clipped: 2 common of 3 predicted, 2 gold.
        ("Denver Denver Broncos", "Denver Broncos", 0, 0.8),
        # P = 1/1, R = 1/3: F1 = 2 * (1/3) / (4/3) = 0.5
        ("Clara", "Santa Clara, California", 0, 0.5),
        ("Carolina Panthers", "Denver Broncos", 0, 0.0),
    ],
)
def test_exact_match_and_f1_worked_examples(prediction, gold, exact, f1):
    assert exact_match_score(prediction, gold) == exact
    assert f1_score(prediction, gold) == pytest.approx(f1)
    assert f1_score(prediction, gold, version="1.1") == pytest.approx(f1)


def test_empty_answers_follow_each_version():
    assert f1_score("", "") == 1 and f1_score("the", "") == 1  # both normalise to nothing
    assert f1_score("", "Denver") == 0 and f1_score("Denver", "") == 0
    assert f1_score("", "", version="1.1") == 0
    assert exact_match_score("", "") == 1


def test_squad_scores_v1_1_takes_the_best_gold_and_counts_missing_as_zero():
    golds = {
        "q1": ["Denver Broncos", "The Broncos"],
        "q2": ["Santa Clara, California", "Levi's Stadium"],
        "q3": ["Carolina Panthers"],
    }
    predictions = {"q1": "Broncos", "q2": "Santa Clara"}
    # q1: "broncos" equals the normalised "The Broncos": EM 1, F1 1.
    # q2: P = 2/2, R = 2/3 against the first gold: F1 0.8, EM 0.
    # q3: missing: 0 and 0.
    scores = squad_scores(golds, predictions, version="1.1")
    assert scores["exact_match"] == pytest.approx(100 * 1 / 3)
    assert scores["f1"] == pytest.approx(100 * 1.8 / 3)
    assert (scores["total"], scores["missing"]) == (3, 1)


def test_squad_scores_v2_0_scores_no_answer():
    golds = {"answerable": ["Denver Broncos"], "unanswerable": []}
    assert squad_scores(golds, {"answerable": "Denver Broncos", "unanswerable": ""}, "2.0")[
        "exact_match"
    ] == pytest.approx(100.0)
    scores = squad_scores(golds, {"answerable": "", "unanswerable": "Denver"}, "2.0")
    assert scores["exact_match"] == 0 and scores["f1"] == 0


def test_squad_scores_rejects_unknown_ids_and_versions():
    with pytest.raises(ValueError, match=r"not in the dataset.*'q9'"):
        squad_scores({"q1": ["a"]}, {"q9": "a"})
    with pytest.raises(ValueError, match=r"version='3\.0'"):
        squad_scores({"q1": ["a"]}, {"q1": "a"}, version="3.0")
