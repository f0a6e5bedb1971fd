"""tfgpt: transformer language models for Keras 3 / TensorFlow 2.

The models and configs are importable from here (`from tfgpt import GPT`).
They are loaded on first use, so that `import tfgpt.config` and every
command's `--help` run without importing TensorFlow.
"""

import importlib

from tfgpt import quiet

quiet.quiet_tensorflow()

__version__ = "0.1.0"

_EXPORTS = {
    "GPT": "tfgpt.models.gpt",
    "GPTConfig": "tfgpt.config",
    "GPT_PRESETS": "tfgpt.config",
    "Albert": "tfgpt.models.albert",
    "AlbertBackbone": "tfgpt.models.albert",
    "AlbertConfig": "tfgpt.config",
    "ALBERT_PRESETS": "tfgpt.config",
    "Bert": "tfgpt.models.bert",
    "BertBackbone": "tfgpt.models.bert",
    "BertConfig": "tfgpt.config",
    "BERT_PRESETS": "tfgpt.config",
    "SequenceClassifier": "tfgpt.models.sequence_classifier",
    "SpanQuestionAnswerer": "tfgpt.models.span_question_answerer",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tfgpt' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
