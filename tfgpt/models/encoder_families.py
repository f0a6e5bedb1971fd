"""The encoder families, each a folder of tfgpt/models/: the one list a new family joins.

Importing this module does not import TensorFlow (`tfgpt.config` reads the
presets, tasks and models from here).
"""

from tfgpt.models import albert, bert, roberta

# In the order `--help` lists their presets.
ENCODER_FAMILIES = {family.name: family for family in (bert.FAMILY, albert.FAMILY, roberta.FAMILY)}
