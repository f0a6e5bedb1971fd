"""GPT-J (Wang and Komatsuzaki 2021): switches of tfgpt's GPT.

One layer norm feeding attention and the feed-forward network in parallel,
rotary positions on the first `rotary_dim` features of each head turned in
adjacent pairs, no attention biases, an untied head with a bias.
"""

from tfgpt.models.decoder_family import DecoderFamily
from tfgpt.models.gptj.presets import PRESETS

FAMILY = DecoderFamily(
    name="gptj",
    architectures={"gptj": "GPTJForCausalLM"},
    presets=PRESETS,
    conversion="tfgpt.models.gptj.hf_conversion",
)
