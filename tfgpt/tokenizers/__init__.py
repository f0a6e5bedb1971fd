"""Tokenizers that run inside the TensorFlow graph."""

from tfgpt.tokenizers.byte_pair_tokenizer import BytePairTokenizer

__all__ = ["BytePairTokenizer", "check_tokenizer_matches_model"]


def check_tokenizer_matches_model(tokenizer, model):
    """Raises ValueError if the tokenizer can produce ids the model lacks.

    A larger model vocabulary is allowed (tables padded to a round size, as
    the trainer's `--vocabulary-size` permits).
    """
    if tokenizer.vocabulary_size > model.vocabulary_size:
        raise ValueError(
            "The tokenizer's vocabulary does not match the model: it has more "
            f"ids than the embedding table. Received: tokenizer vocabulary "
            f"size={tokenizer.vocabulary_size}, model "
            f"vocabulary_size={model.vocabulary_size}"
        )

