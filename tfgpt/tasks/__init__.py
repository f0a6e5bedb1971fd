"""Fine-tuning tasks: data readers, featurizers and metrics (SQuAD, classification)."""
