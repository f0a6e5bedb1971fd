"""BERT (Devlin et al. 2019): a bidirectional encoder pretrained by masked LM and
next-sentence prediction.

`BertBackbone` and `Bert` (`models.py`; loaded on first use, so that this
declaration imports no TensorFlow) with `tfgpt.config.BertConfig`, its
presets (`presets.py`) and its transformers layout (`hf_conversion.py`:
`BertModel`, `BertForPreTraining`, `BertForSequenceClassification`,
`BertForQuestionAnswering`).
"""

from tfgpt.lazy import lazy_exports
from tfgpt.models.bert.presets import PRESETS
from tfgpt.models.encoder_family import EncoderFamily

FAMILY = EncoderFamily(
    name="bert",
    title="BERT",
    config_class="BertConfig",
    presets=PRESETS,
    tasks=("mlm+nsp", "mlm"),
    backbone="tfgpt.models.bert.models:BertBackbone",
    pretraining_model="tfgpt.models.bert.models:Bert",
    conversion="tfgpt.models.bert.hf_conversion",
    finetuning=True,
)

__getattr__, __dir__ = lazy_exports(__name__, {"Bert": "tfgpt.models.bert.models",
                                               "BertBackbone": "tfgpt.models.bert.models"})
