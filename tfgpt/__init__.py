"""tfgpt: transformer language models for Keras 3 / TensorFlow 2."""

from tfgpt.config import (
    ALBERT_PRESETS,
    BERT_PRESETS,
    GPT_PRESETS,
    AlbertConfig,
    BertConfig,
    GPTConfig,
)
from tfgpt.models.albert import Albert, AlbertBackbone
from tfgpt.models.bert import Bert, BertBackbone
from tfgpt.models.gpt import GPT
from tfgpt.models.sequence_classifier import SequenceClassifier
from tfgpt.models.span_question_answerer import SpanQuestionAnswerer

__version__ = "0.1.0"
__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "Albert",
    "AlbertBackbone",
    "AlbertConfig",
    "ALBERT_PRESETS",
    "Bert",
    "BertBackbone",
    "BertConfig",
    "BERT_PRESETS",
    "SequenceClassifier",
    "SpanQuestionAnswerer",
]
