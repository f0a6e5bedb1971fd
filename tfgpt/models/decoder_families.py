"""The decoder families, each a folder of tfgpt/models/: the one list a new family joins.

Importing this module does not import TensorFlow (`tfgpt.config` reads the
presets from here).
"""

from tfgpt.models import gpt2, gpt_neo, gpt_neox, gptj, llama

# In the order `--help` lists their presets.
DECODER_FAMILIES = {family.name: family for family in (
    gpt2.FAMILY, llama.FAMILY, gptj.FAMILY, gpt_neo.FAMILY, gpt_neox.FAMILY)}
# Every transformers model_type a family reads -> its family.
MODEL_TYPES = {model_type: family for family in DECODER_FAMILIES.values()
               for model_type in family.architectures}
