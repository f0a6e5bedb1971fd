"""SQuAD v1.1 / v2.0: reading, windowed features for long contexts, answer extraction.

The steps of extractive question answering with an encoder (Devlin et al.
2019, Section 4.2-4.3; Google's `run_squad.py`):

1. `read_squad(path)` reads the official JSON layout
   (`data[].paragraphs[].{context, qas[]}`) and checks every answer span
   against its context.
2. `squad_features(examples, tokenizer, ...)` builds
   `[CLS] question [SEP] window [SEP]` inputs. A context longer than the
   room left by the question is cut into overlapping windows whose starts
   are `stride` tokens apart. Each window labels the answer's first and
   last token, or position 0 ([CLS]) when the answer is not wholly inside
   it or the question is unanswerable.
3. The model (`SpanQuestionAnswerer`) scores each token as start and end.
4. `postprocess_predictions(...)` picks, per question, the best-scoring
   valid span over all of its windows and maps it back to the exact
   characters of the context (SQuAD v2.0: or "" when the no-answer score
   wins).

The tokenizer is any object with `encode_with_offsets(text)` returning
`(ids, offsets)`, `offsets[i] = (start, end)` the characters of `text` that
token i covers, and integer attributes `cls_id`, `sep_id` and `pad_id`.

Example:
>>> version, examples = read_squad("dev-v1.1.json")  # doctest: +SKIP
>>> features = squad_features(examples, tokenizer, max_sequence_length=384)  # doctest: +SKIP
"""

import collections
import dataclasses
import json

import numpy as np


@dataclasses.dataclass(frozen=True)
class SquadExample:
    """One question about one context.

    Args:
        question_id: str. The dataset's `id`.
        question: str.
        context: str.
        answers: tuple of (text, start) pairs, `start` the character offset
            of `text` in `context`; empty for an unanswerable question.
        is_impossible: bool. SQuAD v2.0's unanswerable questions.
    """

    question_id: str
    question: str
    context: str
    answers: tuple
    is_impossible: bool = False


def read_squad(path):
    """Reads a SQuAD v1.1 or v2.0 JSON file.

    Args:
        path: str. A file in the official layout.

    Returns:
        `(version, examples)`: the file's `"version"` as "1.1" or "2.0"
        (the official v2.0 files say "v2.0"; a file without a version
        counts as "2.0" if it has `is_impossible` fields) and a list of
        `SquadExample`.

    Raises:
        ValueError: naming the file and the question id for an answer whose
            text is not at its `answer_start` in the context, an answerable
            question without answers, an unanswerable one with answers, a
            repeated id or a missing field.
    """
    try:
        with open(path, encoding="utf-8") as file:
            dataset = json.load(file)
    except OSError as error:
        raise ValueError(f"Cannot read SQuAD file {path} ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: malformed JSON ({error})") from None
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise ValueError(f"{path}: not a SQuAD file (no top-level \"data\" list)")

    examples = []
    seen = set()
    has_impossible = False
    for article_index, article in enumerate(dataset["data"]):
        for paragraph_index, paragraph in enumerate(article.get("paragraphs", [])):
            where = f"{path}: data[{article_index}].paragraphs[{paragraph_index}]"
            context = paragraph.get("context")
            if not isinstance(context, str) or not isinstance(paragraph.get("qas"), list):
                raise ValueError(f"{where}: needs a \"context\" string and a \"qas\" list")
            for question in paragraph["qas"]:
                example = _read_question(question, context, where)
                if example.question_id in seen:
                    raise ValueError(
                        f"{where}: question id {example.question_id!r} appears more than once"
                    )
                seen.add(example.question_id)
                has_impossible = has_impossible or "is_impossible" in question
                examples.append(example)
    # The official files say "1.1" and "v2.0".
    version = str(dataset.get("version") or ("2.0" if has_impossible else "1.1")).removeprefix("v")
    if version not in ("1.1", "2.0"):
        raise ValueError(f"{path}: unknown SQuAD version. Received: version={version!r}")
    return version, examples


def _read_question(question, context, where):
    question_id = question.get("id")
    if not isinstance(question_id, str) or not isinstance(question.get("question"), str):
        raise ValueError(f"{where}: every question needs an \"id\" and a \"question\" string")
    is_impossible = bool(question.get("is_impossible", False))
    answers = []
    for answer in question.get("answers", []):
        text, start = answer.get("text"), answer.get("answer_start")
        if (
            not isinstance(text, str)
            or not text
            or isinstance(start, bool)
            or not isinstance(start, int)
        ):
            raise ValueError(
                f"{where}: question {question_id!r}: an answer needs a non-empty \"text\" "
                f"and an integer \"answer_start\". Received: text={text!r}, "
                f"answer_start={start!r}"
            )
        found = context[start : start + len(text)] if start >= 0 else ""
        if found != text:
            raise ValueError(
                f"{where}: question {question_id!r}: answer text {text!r} does not match "
                f"its context at answer_start={start} (the context has {found!r} there)"
            )
        answers.append((text, start))
    if is_impossible and answers:
        raise ValueError(
            f"{where}: question {question_id!r} is marked is_impossible but has "
            f"{len(answers)} answer(s)"
        )
    if not is_impossible and not answers:
        raise ValueError(
            f"{where}: question {question_id!r} has no answers and is not marked is_impossible"
        )
    return SquadExample(
        question_id=question_id,
        question=question["question"],
        context=context,
        answers=tuple(answers),
        is_impossible=is_impossible,
    )


@dataclasses.dataclass
class SquadFeatures:
    """Model inputs and labels for SQuAD windows, with what maps them back.

    Every array has one row per window (N windows, T = max_sequence_length):

    - `token_ids`, `segment_ids`, `padding_mask`: int32 (N, T), the
      encoder inputs.
    - `start_positions`, `end_positions`: int32 (N,), the answer's first
      and last token in the window, 0 ([CLS]) if it is not wholly inside.
    - `example_index`: int32 (N,), the window's example in the list given
      to `squad_features`.
    - `token_offsets`: int32 (N, T, 2), the context characters
      `[start, end)` of each context token; -1 for the question, special
      tokens and padding.
    - `is_max_context`: bool (N, T), true where this window gives the token
      more context on its shorter side than any other window (Google's
      `_check_is_max_context`), so each token is scored in one window.
    """

    token_ids: np.ndarray
    segment_ids: np.ndarray
    padding_mask: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray
    example_index: np.ndarray
    token_offsets: np.ndarray
    is_max_context: np.ndarray

    def inputs(self):
        """The encoder inputs as a dict, ready for `tf.data.Dataset.from_tensor_slices`."""
        return {
            "token_ids": self.token_ids,
            "segment_ids": self.segment_ids,
            "padding_mask": self.padding_mask,
        }

    def labels(self):
        """The span labels as a dict keyed like `SpanQuestionAnswerer`'s outputs."""
        return {"start_logits": self.start_positions, "end_logits": self.end_positions}


def _windows(num_tokens, window_length, stride):
    """Start and length of each window over `num_tokens` context tokens."""
    windows = []
    start = 0
    while True:
        length = min(window_length, num_tokens - start)
        windows.append((start, length))
        if start + length >= num_tokens:
            return windows
        start += stride


def squad_features(
    examples,
    tokenizer,
    max_sequence_length=384,
    stride=128,
    max_question_length=64,
):
    """Tokenises SQuAD examples into fixed-length, possibly overlapping windows.

    Args:
        examples: list of `SquadExample`.
        tokenizer: an object with `encode_with_offsets(text)` -> `(ids,
            offsets)` and integer `cls_id`, `sep_id`, `pad_id` attributes.
        max_sequence_length: int. Length T of every window, special tokens
            included.
        stride: int. Tokens between the starts of successive windows of one
            context (Google's `doc_stride`); at most
            `max_sequence_length - max_question_length - 3`, so that no
            token is skipped.
        max_question_length: int. Questions are cut to this many tokens.

    Returns:
        `SquadFeatures`.

    Raises:
        ValueError: for sizes that leave no room for the context or skip
            tokens, and, naming the question id, for an answer that covers
            no token of its context.
    """
    for name, value in (
        ("max_sequence_length", max_sequence_length),
        ("stride", stride),
        ("max_question_length", max_question_length),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    # Context tokens per window after the longest question, [CLS] and 2 x [SEP].
    window_length = max_sequence_length - max_question_length - 3
    if window_length < 1:
        raise ValueError(
            "`max_sequence_length` leaves no room for the context after the longest "
            "question and 3 special tokens. Received: "
            f"max_sequence_length={max_sequence_length}, "
            f"max_question_length={max_question_length}"
        )
    if stride > window_length:
        raise ValueError(
            "`stride` must be at most the context tokens per window, "
            "max_sequence_length - max_question_length - 3, or tokens between windows "
            f"are skipped. Received: stride={stride}, max_sequence_length="
            f"{max_sequence_length}, max_question_length={max_question_length}"
        )
    rows = collections.defaultdict(list)
    for example_index, example in enumerate(examples):
        question_ids = list(tokenizer.encode_with_offsets(example.question)[0])
        question_ids = question_ids[:max_question_length]
        context_ids, context_offsets = tokenizer.encode_with_offsets(example.context)
        context_ids = list(context_ids)
        context_offsets = [tuple(offset) for offset in context_offsets]
        # A question shorter than max_question_length leaves more room.
        room = max_sequence_length - len(question_ids) - 3
        answer_tokens = _answer_token_span(example, context_offsets)
        windows = _windows(len(context_ids), room, stride)
        for window_index, (window_start, window_size) in enumerate(windows):
            first_context_position = len(question_ids) + 2
            ids = [tokenizer.cls_id, *question_ids, tokenizer.sep_id]
            ids += context_ids[window_start : window_start + window_size] + [tokenizer.sep_id]
            segments = [0] * first_context_position + [1] * (window_size + 1)
            offsets = np.full((max_sequence_length, 2), -1, np.int32)
            max_context = np.zeros(max_sequence_length, bool)
            for i in range(window_size):
                offsets[first_context_position + i] = context_offsets[window_start + i]
                max_context[first_context_position + i] = _is_max_context(
                    windows, window_index, window_start + i
                )
            start_position = end_position = 0
            if answer_tokens is not None:
                first, last = answer_tokens
                if window_start <= first and last < window_start + window_size:
                    start_position = first - window_start + first_context_position
                    end_position = last - window_start + first_context_position
            padding = max_sequence_length - len(ids)
            rows["token_ids"].append(ids + [tokenizer.pad_id] * padding)
            rows["segment_ids"].append(segments + [0] * padding)
            rows["padding_mask"].append([1] * len(ids) + [0] * padding)
            rows["start_positions"].append(start_position)
            rows["end_positions"].append(end_position)
            rows["example_index"].append(example_index)
            rows["token_offsets"].append(offsets)
            rows["is_max_context"].append(max_context)
    if not rows:
        raise ValueError("`examples` is empty.")
    return SquadFeatures(
        token_ids=np.asarray(rows["token_ids"], np.int32),
        segment_ids=np.asarray(rows["segment_ids"], np.int32),
        padding_mask=np.asarray(rows["padding_mask"], np.int32),
        start_positions=np.asarray(rows["start_positions"], np.int32),
        end_positions=np.asarray(rows["end_positions"], np.int32),
        example_index=np.asarray(rows["example_index"], np.int32),
        token_offsets=np.stack(rows["token_offsets"]),
        is_max_context=np.stack(rows["is_max_context"]),
    )


def _answer_token_span(example, context_offsets):
    """First and last context token of the example's first answer, or None."""
    if example.is_impossible or not example.answers:
        return None
    text, start_char = example.answers[0]
    end_char = start_char + len(text)
    covering = [
        index
        for index, (token_start, token_end) in enumerate(context_offsets)
        if token_start < end_char and token_end > start_char
    ]
    if not covering:
        raise ValueError(
            f"question {example.question_id!r}: answer {text!r} at characters "
            f"[{start_char}, {end_char}) covers no token of the context"
        )
    return covering[0], covering[-1]


def _is_max_context(windows, window_index, token_index):
    """Whether window `window_index` is the best of all windows holding the token.

    A window's score for a token is min(tokens left of it, tokens right of
    it) + 0.01 * window length; ties go to the earlier window.
    """
    best_score, best_window = None, None
    for index, (start, length) in enumerate(windows):
        end = start + length - 1
        if not start <= token_index <= end:
            continue
        score = min(token_index - start, end - token_index) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best_window = score, index
    return best_window == window_index


def postprocess_predictions(
    examples,
    features,
    start_logits,
    end_logits,
    n_best=20,
    max_answer_length=30,
    allow_no_answer=False,
    no_answer_threshold=0.0,
):
    """Turns start/end logits of every window into one answer string per question.

    For each question, over all of its windows, considers the `n_best`
    highest start and end logits; a span (i, j) is valid if both tokens are
    context tokens, i is in the window where it has maximum context,
    i <= j and j - i + 1 <= `max_answer_length`. The answer is the context
    text from the start of token i to the end of token j of the valid span
    with the largest `start_logits[i] + end_logits[j]`.

    With `allow_no_answer` (SQuAD v2.0) the no-answer score is the smallest
    `start_logits[0] + end_logits[0]` over the question's windows, and the
    answer is "" when it exceeds the best span's score by more than
    `no_answer_threshold`.

    Args:
        examples: list of `SquadExample`, as given to `squad_features`.
        features: `SquadFeatures`.
        start_logits, end_logits: float arrays (N, T), one row per window.
        n_best: int. Candidate starts and ends per window.
        max_answer_length: int. Longest answer, in tokens.
        allow_no_answer: bool. Predict "" when no answer scores best.
        no_answer_threshold: float. Margin the no-answer score needs.

    Returns:
        dict {question id: answer text}; "" when there is no valid span.
    """
    start_logits = np.asarray(start_logits, np.float32)
    end_logits = np.asarray(end_logits, np.float32)
    expected = features.token_ids.shape
    if start_logits.shape != expected or end_logits.shape != expected:
        raise ValueError(
            f"`start_logits` and `end_logits` must have the features' shape {expected}. "
            f"Received: {start_logits.shape} and {end_logits.shape}"
        )
    windows_of = collections.defaultdict(list)
    for row, example_index in enumerate(features.example_index):
        windows_of[int(example_index)].append(row)

    predictions = {}
    for example_index, example in enumerate(examples):
        best_score, best_text = -np.inf, ""
        no_answer_score = np.inf
        for row in windows_of[example_index]:
            starts, ends = start_logits[row], end_logits[row]
            offsets = features.token_offsets[row]
            no_answer_score = min(no_answer_score, starts[0] + ends[0])
            for i in np.argsort(starts)[::-1][:n_best]:
                if offsets[i, 0] < 0 or not features.is_max_context[row, i]:
                    continue
                for j in np.argsort(ends)[::-1][:n_best]:
                    if offsets[j, 0] < 0 or j < i or j - i + 1 > max_answer_length:
                        continue
                    score = starts[i] + ends[j]
                    if score > best_score:
                        best_score = score
                        best_text = example.context[offsets[i, 0] : offsets[j, 1]]
        if allow_no_answer and no_answer_score - best_score > no_answer_threshold:
            best_text = ""
        predictions[example.question_id] = best_text
    return predictions


def gold_answers(examples):
    """{question id: list of gold answer texts} for `squad_metrics.squad_scores`."""
    return {example.question_id: [text for text, _ in example.answers] for example in examples}
