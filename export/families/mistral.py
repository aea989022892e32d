"""Mistral: the Llama layout without biases, every layer attending through a sliding window."""

from paradecode.export.families.base import register
from paradecode.export.families.llama import Llama


@register
class Mistral(Llama):
    name = "mistral"
    model_types = ("mistral",)
    examples = "Mistral 7B"

    def biases(self, config):
        return False, False

    def windows(self, config):
        window = getattr(config, "sliding_window", None)
        return () if window is None else (window,) * config.num_hidden_layers
