"""RoBERTa (Liu et al. 2019): BERT's encoder with positions that skip padding,
pretrained by masked LM alone.

`RobertaBackbone` and `Roberta` (`models.py`; loaded on first use, so that
this declaration imports no TensorFlow) with `tfgpt.config.RobertaConfig`, its
presets (`presets.py`) and its transformers layout (`hf_conversion.py`:
`RobertaModel`, `RobertaForMaskedLM`, `RobertaForQuestionAnswering`). Not
fine-tuned yet: its byte-level BPE tokenizer has no offsets for SQuAD, and a
question-context pair has one segment.
"""

from tfgpt.lazy import lazy_exports
from tfgpt.models.encoder_family import EncoderFamily
from tfgpt.models.roberta.presets import PRESETS

FAMILY = EncoderFamily(
    name="roberta",
    title="RoBERTa",
    config_class="RobertaConfig",
    presets=PRESETS,
    tasks=("mlm",),
    backbone="tfgpt.models.roberta.models:RobertaBackbone",
    pretraining_model="tfgpt.models.roberta.models:Roberta",
    conversion="tfgpt.models.roberta.hf_conversion",
    finetuning=False,
)

__getattr__, __dir__ = lazy_exports(__name__, {"Roberta": "tfgpt.models.roberta.models",
                                               "RobertaBackbone": "tfgpt.models.roberta.models"})
