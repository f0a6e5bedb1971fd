"""tfgpt: transformer language models for Keras 3 / TensorFlow 2.

The models and configs are importable from here (`from tfgpt import GPT`).
They are loaded on first use, so that `import tfgpt.config` and every
command's `--help` run without importing TensorFlow.
"""

from tfgpt import quiet
from tfgpt.lazy import lazy_exports

quiet.quiet_tensorflow()

__version__ = "0.1.0"

_MODULES = {
    "tfgpt.models.gpt": ("GPT",),
    "tfgpt.config": ("GPTConfig", "GPT_PRESETS", "BertConfig", "BERT_PRESETS", "AlbertConfig",
                     "ALBERT_PRESETS", "RobertaConfig", "ROBERTA_PRESETS"),
    "tfgpt.models.albert.models": ("Albert", "AlbertBackbone"),
    "tfgpt.models.bert.models": ("Bert", "BertBackbone"),
    "tfgpt.models.roberta.models": ("Roberta", "RobertaBackbone"),
    "tfgpt.models.sequence_classifier": ("SequenceClassifier",),
    "tfgpt.models.span_question_answerer": ("SpanQuestionAnswerer",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
