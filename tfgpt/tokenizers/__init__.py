"""Tokenizers that run inside the TensorFlow graph."""

from tfgpt.tokenizers.byte_pair_tokenizer import BytePairTokenizer

__all__ = ["BytePairTokenizer"]
