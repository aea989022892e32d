"""The ParaDecode runtime: decode over an export with plain greedy (`ar`) or ParaDecode.

    from paradecode.runtime import load
    model = load("out/stories260K", backend="onnxruntime")
    result = model.generate("Once upon a time", max_new_tokens=64, mode="paradecode")
    print(result.text, result.stats.tokens_per_second)

It needs only `paradecode.graphs` and the chosen backend's library: never transformers or the
exporter, so a service can run an export with the runtime alone.
"""

from paradecode.runtime.chat import ChatTemplate
from paradecode.runtime.config import NEVER, GenerationConfig
from paradecode.runtime.model import GenerationStream, ParaDecodeModel, StreamedToken, load
from paradecode.runtime.stats import GenerationResult, GenerationStats, Mismatch

__all__ = [
    "NEVER",
    "ChatTemplate",
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "Mismatch",
    "ParaDecodeModel",
    "StreamedToken",
    "load",
]
