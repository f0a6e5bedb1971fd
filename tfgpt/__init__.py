"""tfgpt: transformer language models for Keras 3 / TensorFlow 2."""

from tfgpt.config import GPT_PRESETS, GPTConfig
from tfgpt.models.gpt import GPT

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "GPT_PRESETS"]
