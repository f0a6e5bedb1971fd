"""GPT-NeoX and Pythia (Black et al. 2022, Biderman et al. 2023): switches of tfgpt's GPT.

Two layer norms in parallel (or sequential when `use_parallel_residual` is
false), split-halves rotary positions on a `partial_rotary_factor` of each
head, biases everywhere, an untied head; the query, key and value
projections fused per head.
"""

from tfgpt.models.decoder_family import DecoderFamily
from tfgpt.models.gpt_neox.presets import PRESETS

FAMILY = DecoderFamily(
    name="gpt_neox",
    architectures={"gpt_neox": "GPTNeoXForCausalLM"},
    presets=PRESETS,
    conversion="tfgpt.models.gpt_neox.hf_conversion",
)
