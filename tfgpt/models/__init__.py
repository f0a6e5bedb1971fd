"""tfgpt models: backbones with their heads."""

from tfgpt.models.gpt import GPT

__all__ = ["GPT"]
