"""Fine-tuning BERT/ALBERT encoders: the run, and each task's data and metrics.

- `core`: `FinetuneConfig`, its flags and `finetune(...)`, the run.
- `classification`: sentence (pair) classification files and features.
- `squad`, `squad_metrics`: SQuAD v1.1/v2.0 features, answers and scores.
- `offset_tokenizer`: token ids with character offsets for span answers.
"""

from tfgpt.finetuning.core import (
    FinetuneConfig,
    describe_init,
    finetune,
    infer_labels,
    parse_flags,
    restore_backbone,
)

__all__ = [
    "FinetuneConfig",
    "describe_init",
    "finetune",
    "infer_labels",
    "parse_flags",
    "restore_backbone",
]
