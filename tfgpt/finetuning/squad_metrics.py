"""SQuAD exact match and F1, to the official evaluation scripts' definitions.

Both scores compare a predicted string with every gold answer of the
question and keep the best (Rajpurkar et al. 2016, Section 6; the official
`evaluate-v1.1.py` and `evaluate-v2.0.py`). Before comparing, an answer is
normalised: lower-cased, every ASCII punctuation character
(`string.punctuation`) removed, the articles "a", "an" and "the" removed as
whole words, and whitespace runs collapsed to single spaces.

- Exact match: 1 if the normalised strings are equal, else 0.
- F1: over the bags of whitespace tokens of the normalised strings,
  precision = common / predicted, recall = common / gold, and
  F1 = 2PR / (P + R); 0 when nothing is in common.

Version 2.0 differs in three places, all about unanswerable questions:
gold answers that normalise to "" are dropped and a question left without
gold answers has the single gold answer "" (predict "" to score 1); F1 is 1
when both token lists are empty and 0 when only one is. The dataset's
`"version"` field selects the rules, as the official scripts do.

Example:
>>> exact_match_score("The Eiffel Tower!", "eiffel tower")
1
>>> round(f1_score("the Denver Broncos team", "Denver Broncos"), 3)
0.8
"""

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text):
    """Lower-cases and removes punctuation, articles and extra whitespace."""
    text = text.lower()
    text = "".join(character for character in text if character not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction, gold):
    """1 if `prediction` and `gold` are equal after `normalize_answer`, else 0."""
    return int(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction, gold, version="2.0"):
    """Token-level F1 between normalised `prediction` and `gold`.

    With `version="2.0"`, an empty side scores 1 if both are empty and 0
    otherwise; `"1.1"` scores 0 whenever nothing is in common.
    """
    prediction_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if version == "2.0" and (not prediction_tokens or not gold_tokens):
        return int(prediction_tokens == gold_tokens)
    common = collections.Counter(prediction_tokens) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0
    precision = same / len(prediction_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_scores(gold_answers, predictions, version="1.1"):
    """Scores `predictions` against gold answers, as the official scripts do.

    Args:
        gold_answers: dict {question id: list of gold answer strings}; an
            empty list marks an unanswerable (v2.0) question.
        predictions: dict {question id: predicted string}; "" predicts "no
            answer".
        version: str. `"1.1"` or `"2.0"`.

    Returns:
        dict with `exact_match` and `f1` (percentages, 0 to 100), `total`
        (questions scored) and `missing` (questions without a prediction;
        they score 0, as in the v1.1 script; the v2.0 script skips them
        instead, which can only raise the score).

    Raises:
        ValueError: for an unknown `version`, or predictions for question
            ids that are not in `gold_answers` (a sign of a mixed-up file).
    """
    if version not in ("1.1", "2.0"):
        raise ValueError(f"`version` must be '1.1' or '2.0'. Received: version={version!r}")
    unknown = sorted(set(predictions) - set(gold_answers))
    if unknown:
        raise ValueError(
            f"Predictions for {len(unknown)} question id(s) not in the dataset, "
            f"e.g. {unknown[:3]}"
        )
    exact_total = f1_total = 0.0
    missing = 0
    for question_id, golds in gold_answers.items():
        if version == "2.0":
            golds = [gold for gold in golds if normalize_answer(gold)] or [""]
        if question_id not in predictions:
            missing += 1
            continue
        prediction = predictions[question_id]
        exact_total += max(exact_match_score(prediction, gold) for gold in golds)
        f1_total += max(f1_score(prediction, gold, version) for gold in golds)
    total = len(gold_answers)
    return {
        "exact_match": 100.0 * exact_total / total if total else 0.0,
        "f1": 100.0 * f1_total / total if total else 0.0,
        "total": total,
        "missing": missing,
    }
