"""Building blocks of the tfgpt models."""

from tfgpt.layers.causal_self_attention import CausalSelfAttention
from tfgpt.layers.classification_head import ClassificationHead
from tfgpt.layers.encoder_embedding import EncoderEmbedding
from tfgpt.layers.layer_norm import LayerNorm
from tfgpt.layers.masked_lm_head import MaskedLMHead
from tfgpt.layers.rms_norm import RMSNorm
from tfgpt.layers.self_attention import SelfAttention
from tfgpt.layers.span_head import SpanHead
from tfgpt.layers.token_and_position_embedding import TokenAndPositionEmbedding
from tfgpt.layers.transformer_block import TransformerBlock

__all__ = [
    "CausalSelfAttention",
    "TokenAndPositionEmbedding",
    "TransformerBlock",
    "ClassificationHead",
    "EncoderEmbedding",
    "LayerNorm",
    "MaskedLMHead",
    "RMSNorm",
    "SelfAttention",
    "SpanHead",
]
