"""GPT-2 (Radford et al. 2019): tfgpt's GPT with its default switches.

Learned positions, LayerNorm, biases everywhere, a GELU feed-forward
network, a head tied to the token table; the presets add tfgpt's own small
`gpt-demo` and `gpt-mini`. The conversion (`hf_conversion.py`) reads and
writes transformers' `GPT2LMHeadModel`, with its tokenizer's `vocab.json` and
`merges.txt` (`python -m tfgpt.convert`).
"""

from tfgpt.models.decoder_family import DecoderFamily
from tfgpt.models.gpt2.presets import PRESETS

FAMILY = DecoderFamily(
    name="gpt2",
    architectures={"gpt2": "GPT2LMHeadModel"},
    presets=PRESETS,
    conversion="tfgpt.models.gpt2.hf_conversion",
)
