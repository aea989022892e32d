"""The contracts the exporter and the runtime share.

`graphs` defines what an export *is*: the model description (`ModelSpec`), the subgraph torch
modules (embed, decoder layer, exit/final head), the tensor names, shapes and dtypes of every
subgraph's inputs and outputs, and the versioned manifest. It depends on torch only (no
transformers, no onnx), so the runtime can load an export with it alone.
"""

from paradecode.graphs.errors import (
    ManifestError,
    MissingDependencyError,
    ParadecodeError,
    UnsupportedModelError,
    UserInputError,
    ValidationError,
)
from paradecode.graphs.spec import ModelSpec

__all__ = [
    "ManifestError",
    "MissingDependencyError",
    "ModelSpec",
    "ParadecodeError",
    "UnsupportedModelError",
    "UserInputError",
    "ValidationError",
]
