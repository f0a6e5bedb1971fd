"""GPT-Neo (Black et al. 2021): switches of tfgpt's GPT.

GPT-2's blocks with unscaled scores, no query/key/value biases, and local
attention (a sliding window) in every second layer.
"""

from tfgpt.models.decoder_family import DecoderFamily
from tfgpt.models.gpt_neo.presets import PRESETS

FAMILY = DecoderFamily(
    name="gpt_neo",
    architectures={"gpt_neo": "GPTNeoForCausalLM"},
    presets=PRESETS,
    conversion="tfgpt.models.gpt_neo.hf_conversion",
)
