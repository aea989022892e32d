"""Backends: the same subgraph calls on torch, onnxruntime or TensorRT, behind one interface.

Each backend's module is imported only when it is asked for, so `import paradecode.runtime` needs
neither onnxruntime nor TensorRT.
"""

from __future__ import annotations

import importlib

from paradecode.graphs.errors import MissingDependencyError, UserInputError
from paradecode.runtime.backends.base import Backend

BACKENDS = {
    "torch": ("paradecode.runtime.backends.torch_backend", "TorchBackend", "torch is a dependency of paradecode"),
    "onnxruntime": (
        "paradecode.runtime.backends.onnxruntime_backend",
        "OnnxRuntimeBackend",
        "`pip install paradecode[cpu]` (onnxruntime) or `paradecode[gpu]` (onnxruntime-gpu)",
    ),
    "tensorrt": (
        "paradecode.runtime.backends.tensorrt_backend",
        "TensorRTBackend",
        "`pip install paradecode[tensorrt] --extra-index-url https://pypi.nvidia.com`, on an NVIDIA GPU, "
        "and export with --engine tensorrt",
    ),
}


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise UserInputError(f"backend {name!r} is not one of {', '.join(BACKENDS)}.")
    module_name, class_name, hint = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise MissingDependencyError(f"the {name} backend is not installed ({err}): {hint}.") from err
    return getattr(module, class_name)


__all__ = ["BACKENDS", "Backend", "backend_class"]
