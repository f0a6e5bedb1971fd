"""RoBERTa's presets: RobertaConfig's defaults are roberta-base's, the presets add the sizes."""

from tfgpt.models.bert.presets import sized

# roberta-base 124,645,632 and roberta-large 355,359,744 (backbones with a
# pooler, as transformers' RobertaModel); the masked-LM model adds its head
# and keeps the pooler, which transformers' RobertaForMaskedLM leaves out.
# Liu et al. 2019, as released: BERT's shapes, 512 tokens (514 position rows).
PRESETS = {
    # Sized for a 2-core CPU, like bert-demo.
    "roberta-demo": sized(4, 192, 4, vocabulary_size=2000, max_sequence_length=128,
                          dropout=0.0),
    "roberta-base": sized(12, 768, 12),
    "roberta-large": sized(24, 1024, 16),
}
