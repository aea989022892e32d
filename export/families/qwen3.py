"""Qwen3: the Llama layout with RMSNorm on each query and key head (q/k norm)."""

from paradecode.export.families.base import register
from paradecode.export.families.llama import Llama
from paradecode.export.families.qwen2 import windows_from_layer_types


@register
class Qwen3(Llama):
    name = "qwen3"
    model_types = ("qwen3",)
    examples = "Qwen3 dense"
    qk_norm = True

    def windows(self, config):
        return windows_from_layer_types(config)
