"""Building blocks of the tfgpt models."""

from tfgpt.layers.causal_self_attention import CausalSelfAttention
from tfgpt.layers.token_and_position_embedding import TokenAndPositionEmbedding
from tfgpt.layers.transformer_block import TransformerBlock

__all__ = ["CausalSelfAttention", "TokenAndPositionEmbedding", "TransformerBlock"]
