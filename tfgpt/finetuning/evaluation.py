"""Fine-tuning evaluation: every worker predicts its share, all of them score it all.

Evaluation at the end reads the whole validation file. Each worker
predicts its share of it (record or question i goes to worker
i mod workers); the predictions are gathered on every worker through the
distribution's `allreduce_mean` (see `gather_objects`), and accuracy, or
exact match and F1 to the official SQuAD definitions
(`tfgpt.finetuning.squad_metrics`), are computed over all of them.
"""

import json

import numpy as np
import tensorflow as tf

from tfgpt.finetuning.classification import encode_classification
from tfgpt.finetuning.data import squad_windows
from tfgpt.finetuning.squad import gold_answers, postprocess_predictions
from tfgpt.finetuning.squad_metrics import squad_scores
from tfgpt.graph_function import graph_function


def gather_objects(value, distribution):
    """Every worker's `value` (JSON-serialisable), in rank order, on every worker.

    The distribution interface has no allgather, so this is one built from
    `allreduce_mean`: each worker writes its UTF-8 JSON into its own row of
    a zero matrix; the mean over workers times their number is the matrix
    with every row filled. Bytes and lengths are small integers, exact in
    float64. Costs workers x longest payload x 8 bytes of traffic.
    """
    workers = distribution.num_workers
    if workers == 1:
        return [value]
    payload = np.frombuffer(json.dumps(value).encode("utf-8"), np.uint8)

    def summed(array):
        mean = distribution.allreduce_mean(tf.constant(array, tf.float64)).numpy()
        return np.rint(mean * workers).astype(np.int64)

    lengths = np.zeros(workers)
    lengths[distribution.rank] = len(payload)
    lengths = summed(lengths)
    table = np.zeros((workers, max(int(lengths.max()), 1)))
    table[distribution.rank, : len(payload)] = payload
    table = summed(table).astype(np.uint8)
    return [json.loads(table[rank, : lengths[rank]].tobytes()) for rank in range(workers)]


def predict_batches(model, inputs, batch_size, xla):
    """Runs `model` over `inputs` (dict of (N, T) arrays); returns NumPy outputs."""
    predict = graph_function(lambda batch: model(batch, training=False), jit_compile=xla)
    outputs = []
    for batch in tf.data.Dataset.from_tensor_slices(inputs).batch(batch_size):
        outputs.append(tf.nest.map_structure(lambda t: t.numpy(), predict(batch)))
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)


def evaluate_classification(model, config, tokenizer, validation, labels, distribution):
    """`(predicted labels in file order, metrics)`; each worker predicts its share."""
    texts, gold = validation
    mine = list(range(distribution.rank, len(texts), distribution.num_workers))
    predicted = []
    if mine:
        inputs = encode_classification(
            [texts[i] for i in mine], tokenizer, config.max_sequence_length
        )
        logits = predict_batches(model, inputs, config.batch_size, config.xla)
        predicted = np.argmax(logits, -1).tolist()
    by_index = {}
    for part in gather_objects([mine, predicted], distribution):
        by_index.update(zip(*part))
    predicted_ids = np.asarray([by_index[i] for i in range(len(texts))])
    correct = int((predicted_ids == gold).sum())
    metrics = {"accuracy": correct / len(texts), "correct": correct, "total": len(texts)}
    return [labels[i] for i in predicted_ids], metrics


def evaluate_squad(model, config, tokenizer, examples, version, distribution):
    """`({question id: answer}, metrics)`; each worker predicts its share of the questions."""
    mine = examples[distribution.rank :: distribution.num_workers]
    predictions = {}
    if mine:
        features = squad_windows(mine, tokenizer, config)
        outputs = predict_batches(model, features.inputs(), config.batch_size, config.xla)
        predictions = postprocess_predictions(
            mine,
            features,
            outputs["start_logits"],
            outputs["end_logits"],
            n_best=config.n_best,
            max_answer_length=config.max_answer_length,
            allow_no_answer=version == "2.0",
            no_answer_threshold=config.no_answer_threshold,
        )
    gathered = {}
    for part in gather_objects(predictions, distribution):
        gathered.update(part)
    ordered = {example.question_id: gathered[example.question_id] for example in examples}
    scores = squad_scores(gold_answers(examples), ordered, version=version)
    return ordered, {**scores, "version": version}
