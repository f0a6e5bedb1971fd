"""tfgpt models: backbones with their heads."""

from tfgpt.models.albert import Albert, AlbertBackbone
from tfgpt.models.bert import Bert, BertBackbone
from tfgpt.models.gpt import GPT
from tfgpt.models.sequence_classifier import SequenceClassifier
from tfgpt.models.span_question_answerer import SpanQuestionAnswerer

__all__ = [
    "GPT",
    "Albert",
    "AlbertBackbone",
    "Bert",
    "BertBackbone",
    "SequenceClassifier",
    "SpanQuestionAnswerer",
]
