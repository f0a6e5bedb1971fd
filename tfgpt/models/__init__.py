"""tfgpt models: backbones with their heads, and the families' folders.

The model classes load on first use (`tfgpt.lazy`): the families' folders
(`tfgpt.models.llama`, ...) hold presets that `tfgpt.config` reads without
importing TensorFlow.
"""

from tfgpt.lazy import lazy_exports

_MODULES = {
    "tfgpt.models.albert.models": ("Albert", "AlbertBackbone"),
    "tfgpt.models.bert.models": ("Bert", "BertBackbone"),
    "tfgpt.models.gpt": ("GPT",),
    "tfgpt.models.sequence_classifier": ("SequenceClassifier",),
    "tfgpt.models.span_question_answerer": ("SpanQuestionAnswerer",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
