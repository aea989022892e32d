"""Qwen2 / Qwen2.5: the Llama layout with q/k/v biases (no o bias) and optional sliding-window layers."""

from paradecode.export.families.base import register
from paradecode.export.families.llama import Llama


def windows_from_layer_types(config) -> tuple[int | None, ...]:
    """Per-layer windows from transformers' `layer_types` ("sliding_attention" layers use the window)."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not layer_types or window is None or "sliding_attention" not in layer_types:
        return ()
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


@register
class Qwen2(Llama):
    name = "qwen2"
    model_types = ("qwen2",)
    examples = "Qwen2, Qwen2.5"

    def biases(self, config):
        return True, False

    def windows(self, config):
        return windows_from_layer_types(config)
