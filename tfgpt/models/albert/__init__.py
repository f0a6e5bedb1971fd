"""ALBERT (Lan et al. 2020): BERT with factorised embeddings and cross-layer parameter
sharing, pretrained by masked LM and sentence-order prediction.

`AlbertBackbone` and `Albert` (`models.py`; loaded on first use, so that this
declaration imports no TensorFlow) with `tfgpt.config.AlbertConfig`, its
presets (`presets.py`) and its transformers layout (`hf_conversion.py`:
`AlbertModel`, `AlbertForPreTraining`, `AlbertForSequenceClassification`,
`AlbertForQuestionAnswering`).
"""

from tfgpt.lazy import lazy_exports
from tfgpt.models.albert.presets import PRESETS
from tfgpt.models.encoder_family import EncoderFamily

FAMILY = EncoderFamily(
    name="albert",
    title="ALBERT",
    config_class="AlbertConfig",
    presets=PRESETS,
    tasks=("mlm+sop", "mlm"),
    backbone="tfgpt.models.albert.models:AlbertBackbone",
    pretraining_model="tfgpt.models.albert.models:Albert",
    conversion="tfgpt.models.albert.hf_conversion",
    finetuning=True,
)

__getattr__, __dir__ = lazy_exports(__name__, {"Albert": "tfgpt.models.albert.models",
                                               "AlbertBackbone": "tfgpt.models.albert.models"})
