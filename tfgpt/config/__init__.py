"""Configuration: the model families' dataclasses and presets, and TrainConfig.

- `tfgpt.config.models`: `GPTConfig`, `BertConfig`, `AlbertConfig`,
  `RobertaConfig` (on the shared `TransformerConfig` and `EncoderConfig`), their presets and
  `FAMILIES`, the registry of model families.
- `tfgpt.config.training`: `TrainConfig` and its enumerations.
- `tfgpt.config.checks`: argument checks both share.

Importing this package does not import TensorFlow.
"""

from tfgpt.config.checks import require_towers_divide_batch
from tfgpt.config.models import (
    ACTIVATIONS,
    ALBERT_PRESETS,
    BERT_PRESETS,
    ENCODER_FAMILIES,
    FAMILIES,
    FINETUNING_FAMILIES,
    GPT_PRESETS,
    ROBERTA_PRESETS,
    AlbertConfig,
    BertConfig,
    EncoderConfig,
    Family,
    GPTConfig,
    RobertaConfig,
    TransformerConfig,
    family_of_preset,
    validate_albert_config,
    validate_bert_config,
    validate_gpt_config,
    validate_roberta_config,
)
from tfgpt.config.training import (
    ALLREDUCE_BUCKET_MB,
    MIXED_PRECISION,
    OPTIMIZERS,
    SCHEDULES,
    TASKS,
    TrainConfig,
)

__all__ = [
    "ACTIVATIONS",
    "ALBERT_PRESETS",
    "ALLREDUCE_BUCKET_MB",
    "BERT_PRESETS",
    "ENCODER_FAMILIES",
    "FAMILIES",
    "FINETUNING_FAMILIES",
    "GPT_PRESETS",
    "MIXED_PRECISION",
    "OPTIMIZERS",
    "ROBERTA_PRESETS",
    "SCHEDULES",
    "TASKS",
    "AlbertConfig",
    "BertConfig",
    "EncoderConfig",
    "Family",
    "GPTConfig",
    "RobertaConfig",
    "TrainConfig",
    "TransformerConfig",
    "family_of_preset",
    "require_towers_divide_batch",
    "validate_albert_config",
    "validate_bert_config",
    "validate_gpt_config",
    "validate_roberta_config",
]
