"""The ParaDecode runtime: decode over an export with plain greedy (`ar`) or ParaDecode.

    from paradecode.runtime import load
    model = load("out/stories260K", backend="onnxruntime")
    result = model.generate("Once upon a time", max_new_tokens=64, mode="paradecode")
    print(result.text, result.stats.tokens_per_second)

It needs only `paradecode.graphs` and the chosen backend's library: never transformers or the
exporter, so a service can run an export with the runtime alone. The names below are imported when
first used (PEP 562), so that importing a submodule (a command line's, say) does not load torch:
`paradecode-serve` and `paradecode-generate` start, and take Ctrl-C cleanly, within a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "NEVER": "paradecode.runtime.config",
    "ChatTemplate": "paradecode.runtime.chat",
    "GenerationConfig": "paradecode.runtime.config",
    "GenerationResult": "paradecode.runtime.stats",
    "GenerationStats": "paradecode.runtime.stats",
    "GenerationStream": "paradecode.runtime.model",
    "Mismatch": "paradecode.runtime.stats",
    "ParaDecodeModel": "paradecode.runtime.model",
    "StreamedToken": "paradecode.runtime.engine",
    "Tracing": "paradecode.runtime.tracing",
    "load": "paradecode.runtime.model",
}

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
    "Tracing",
    "load",
]

if TYPE_CHECKING:
    from paradecode.runtime.chat import ChatTemplate
    from paradecode.runtime.config import NEVER, GenerationConfig
    from paradecode.runtime.engine import StreamedToken
    from paradecode.runtime.model import GenerationStream, ParaDecodeModel, load
    from paradecode.runtime.stats import GenerationResult, GenerationStats, Mismatch
    from paradecode.runtime.tracing import Tracing


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
