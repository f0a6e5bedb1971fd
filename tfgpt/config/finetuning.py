"""What to fine-tune on which data, and how: `FinetuneConfig`.

Importing this module does not import TensorFlow.
"""

import dataclasses
import typing

from tfgpt.config.models import FAMILIES, FINETUNING_FAMILIES
from tfgpt.config.training import RunConfig, require_one_of

TASKS = ("classification", "squad")
# Input length when --max-sequence-length is 0: BERT's GLUE and SQuAD settings.
DEFAULT_SEQUENCE_LENGTH = {"classification": 128, "squad": 384}


@dataclasses.dataclass
class FinetuneConfig(RunConfig):
    """What to fine-tune on which data, and how.

    The fields are these and `RunConfig`'s. Every field is a flag of
    `finetune_hvd.py` and `finetune_mirrored.py` (`train_file` is
    `--train-file`). The defaults are BERT's fine-tuning recipe (Devlin et
    al. 2019, appendix A.3).

    Args:
        task: str. `classification` (text -> label, accuracy) or `squad`
            (extractive question answering, exact match and F1).
        init: str. The encoder to start from: a tfgpt BERT/ALBERT run
            directory, a Hugging Face BERT/ALBERT directory, or "" for a
            random `preset` (with model flags; for tests).
        preset: str. `bert-*` or `albert-*` preset; used only when `init`
            is "".
        tokenizer: str. Tokenizer file or directory; "" takes the one in
            `init` (required when `init` is "").
        train_file: str. Classification: a GLUE-style `.tsv` (header
            `sentence<TAB>label`) or `.jsonl` (`{"text", "label"}`).
            SQuAD: a v1.1 or v2.0 JSON file.
        validation_file: str. The same layout; evaluated at the end ("" to
            skip evaluation).
        labels: str. Classification: the declared label set, comma
            separated (`negative,positive`); label i of the list is class
            i. "" infers it from the training file: its distinct labels,
            sorted numerically if all are integers (GLUE's `0,1`) and as
            strings otherwise. The validation file's labels must be in
            the set either way.
        max_sequence_length: int. Tokens per input, special tokens
            included; 0 means 128 for classification and 384 for SQuAD.
        doc_stride: int. SQuAD: tokens between the starts of successive
            windows of a long context; at most
            max_sequence_length - max_query_length - 3.
        max_query_length: int. SQuAD: questions are cut to this many tokens.
        max_answer_length: int. SQuAD: longest predicted answer, in tokens.
        n_best: int. SQuAD: candidate starts and ends per window.
        no_answer_threshold: float. SQuAD v2.0: how much the no-answer
            score must beat the best span to predict "".
        classifier_dropout: float. Dropout on the pooled output before the
            classification head, in [0, 1).
        epochs: float. Passes over the training file when `steps` is 0:
            steps = round(epochs x records / global batch), at least 1.
        warmup_fraction: float. Fraction of the steps with linear warmup
            from 0 to the peak learning rate, in [0, 1] (BERT: 0.1).
        steps: int. Optimizer steps; 0 derives them from `epochs`.
        batch_size: int. Sequences (SQuAD: windows) per replica per
            micro-batch: the global batch is batch_size x
            accumulation_steps x replicas.
        learning_rate: float. Peak learning rate (BERT fine-tunes with
            2e-5 to 5e-5); with `scale_learning_rate` it is multiplied by
            the number of replicas.
        scale_learning_rate: bool. Multiply the learning rate by the number
            of replicas (off: fine-tuning rates are tuned per global batch).
        out: str. Output directory: checkpoints, config.json, tokenizer,
            metrics.jsonl, predictions.json, eval_results.json.
        resume: bool. Continue from the latest checkpoint in `out`; the
            architecture and labels come from `out`, not from `init`.
    """

    CHOICES: typing.ClassVar[dict] = {"task": TASKS, **RunConfig.CHOICES}
    POSITIVE_INTS: typing.ClassVar[tuple] = RunConfig.POSITIVE_INTS + (
        "doc_stride", "max_query_length", "max_answer_length", "n_best",
    )
    NON_NEGATIVE_INTS: typing.ClassVar[tuple] = (
        ("steps",) + RunConfig.NON_NEGATIVE_INTS + ("max_sequence_length",)
    )
    PRESETS: typing.ClassVar[tuple] = tuple(
        name for family in FINETUNING_FAMILIES for name in FAMILIES[family].presets
    )
    WARMUP_FLAG: typing.ClassVar[str] = "--warmup-fraction"

    # RunConfig's fields with fine-tuning's defaults.
    steps: int = 0
    batch_size: int = 32
    learning_rate: float = 5e-5
    scale_learning_rate: bool = False
    schedule: str = "linear"
    final_learning_rate_ratio: float = 0.0
    weight_decay: float = 0.01
    out: str = "runs/finetune"
    # Fine-tuning's own.
    task: str = "classification"
    init: str = ""
    preset: str = "bert-demo"
    tokenizer: str = ""
    train_file: str = ""
    validation_file: str = ""
    labels: str = ""
    max_sequence_length: int = 0
    doc_stride: int = 128
    max_query_length: int = 64
    max_answer_length: int = 30
    n_best: int = 20
    no_answer_threshold: float = 0.0
    classifier_dropout: float = 0.1
    epochs: float = 3.0
    warmup_fraction: float = 0.1

    def __post_init__(self):
        require_one_of("task", self.task, TASKS)
        if not self.train_file:
            raise ValueError("`train_file` is required.")
        if not self.init and not self.tokenizer:
            raise ValueError(
                "`tokenizer` is required when `init` is empty (a random model has none)."
            )
        if self.preset not in self.PRESETS:
            raise ValueError(
                f"`preset` must be a BERT or ALBERT preset. Received: preset={self.preset!r}. "
                f"Expected one of: {', '.join(sorted(self.PRESETS))}"
            )
        super().__post_init__()
        if self.steps == 0 and not self.epochs > 0:
            raise ValueError(
                f"`epochs` must be positive when `steps` is 0. Received: epochs={self.epochs!r}"
            )
        for name in ("warmup_fraction", "final_learning_rate_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"`{name}` must be in [0, 1]. Received: {name}={getattr(self, name)!r}"
                )
        if not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(
                "`classifier_dropout` must be in [0, 1). "
                f"Received: classifier_dropout={self.classifier_dropout!r}"
            )
        if self.labels:
            self.declared_labels()  # validates
        if self.max_sequence_length == 0:
            # Resolved here so that config.json records the length used.
            self.max_sequence_length = DEFAULT_SEQUENCE_LENGTH[self.task]
        if self.task == "squad":
            window = self.max_sequence_length - self.max_query_length - 3
            if window < 1:
                raise ValueError(
                    "`max_sequence_length` leaves no room for the context after "
                    "`max_query_length` question tokens and 3 special tokens. Received: "
                    f"max_sequence_length={self.max_sequence_length}, "
                    f"max_query_length={self.max_query_length}"
                )
            if self.doc_stride > window:
                raise ValueError(
                    "`doc_stride` must be at most max_sequence_length - max_query_length - 3 "
                    f"= {window}, or context tokens between windows are never seen. Received: "
                    f"doc_stride={self.doc_stride}"
                )
        elif self.max_sequence_length < 3:
            raise ValueError(
                "`max_sequence_length` must be at least 3 ([CLS] text [SEP]). "
                f"Received: max_sequence_length={self.max_sequence_length}"
            )

    def warmup_steps_of(self, steps):
        return int(round(self.warmup_fraction * steps))

    def steps_for(self, num_records, global_batch):
        """`steps`, or when 0, `epochs` passes over `num_records` in `global_batch`es."""
        if self.steps:
            return self.steps
        return max(1, int(round(self.epochs * num_records / global_batch)))

    def declared_labels(self):
        """The `labels` field as a list, or None when it is to be inferred."""
        if not self.labels:
            return None
        names = [name.strip() for name in self.labels.split(",")]
        if len(names) < 2 or "" in names or len(set(names)) != len(names):
            raise ValueError(
                "`labels` must list at least two distinct, non-empty labels, comma "
                f"separated. Received: labels={self.labels!r}"
            )
        return names
