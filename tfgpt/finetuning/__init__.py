"""Fine-tuning BERT/ALBERT encoders: the run, and each task's data and metrics.

- `finetuner`: `finetune(config, model_overrides, distribution)`, the run.
- `flags`: `parse_flags`, the front ends' flags (`FinetuneConfig`'s, in
  `tfgpt.config.finetuning`, and the encoder configs').
- `data`: the task files, read and checked, and the training batches.
- `task_models`: the encoder from `--init`, the task heads and losses.
- `evaluation`: every worker's share of the predictions, gathered and scored.
- `classification`: sentence (pair) classification files and features.
- `squad`, `squad_metrics`: SQuAD v1.1/v2.0 features, answers and scores.
- `offset_tokenizer`: token ids with character offsets for span answers.

The names below load their module on first use, so that the front ends'
`--help` (which imports `flags`) does not import TensorFlow.
"""

from tfgpt.lazy import lazy_exports

_EXPORTS = {
    "FinetuneConfig": "tfgpt.config.finetuning",
    "parse_flags": "tfgpt.finetuning.flags",
    "finetune": "tfgpt.finetuning.finetuner",
    "infer_labels": "tfgpt.finetuning.data",
    "build_backbone": "tfgpt.finetuning.task_models",
    "describe_init": "tfgpt.finetuning.task_models",
    "restore_backbone": "tfgpt.finetuning.task_models",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
