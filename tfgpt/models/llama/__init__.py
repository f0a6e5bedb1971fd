"""Llama, Mistral and Qwen2: one family of switches of tfgpt's GPT.

RMSNorm, rotary positions in the split-halves convention (with Llama 3.1's
frequency scaling), grouped-query attention, a SwiGLU feed-forward network,
no biases but Qwen2's on the queries, keys and values, Mistral's sliding
window, an untied head (tied in the small Llama 3.2 and Qwen2 models).
"""

from tfgpt.models.decoder_family import DecoderFamily
from tfgpt.models.llama.presets import PRESETS

FAMILY = DecoderFamily(
    name="llama",
    architectures={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM"},
    presets=PRESETS,
    conversion="tfgpt.models.llama.hf_conversion",
)
