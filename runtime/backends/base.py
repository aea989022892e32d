"""The interface every backend implements, and the checks they share.

Lifecycle: construction loads and checks everything (manifest, tensor names, files) and fails with
a clear error; the backend is then used by any number of lanes at once; `close()` (or leaving a
`with` block) frees what it created.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paradecode.graphs.errors import ManifestError
from paradecode.graphs.manifest import Subgraph
from paradecode.graphs.ops import TORCH_DTYPES
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.loader import ExportFolder


@dataclass
class HeadOutput:
    """Top-1 token, its probability and the top-1/top-2 logit margin per position, as Python lists
    (the scheduler reads them one by one; lists are the cheapest form for that)."""

    token: list[int]
    prob: list[float]
    margin: list[float]

    @classmethod
    def of(cls, token: torch.Tensor, prob: torch.Tensor, margin: torch.Tensor) -> HeadOutput:
        """From [1, T] (or [T]) tensors on any device."""
        return cls(token.reshape(-1).tolist(), prob.reshape(-1).tolist(), margin.reshape(-1).tolist())


class Backend:
    name = "base"

    def __init__(self, export: ExportFolder, device: str = "cpu"):
        self.export = export
        self.manifest = export.manifest
        self.spec = export.manifest.spec
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[self.manifest.dtype]
        self.subgraph_names = {sub.io.name for sub in self.manifest.subgraphs}

    # lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Free sessions, contexts and buffers this backend created."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # buffers -------------------------------------------------------------------------------
    def allocate_cache(self) -> KVCache:
        shape = (1, self.spec.num_kv_heads, self.manifest.max_seq_len, self.spec.head_dim)
        return KVCache(self.spec.num_layers, shape, self.dtype, self.device)

    def new_stream(self):
        """A stream for a new lane: a CUDA stream on a GPU, None on a CPU."""
        return torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # subgraph calls (implemented by each backend) --------------------------------------------
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions [1, T] -> hidden [1, T, D] on the backend's device."""
        raise NotImplementedError

    def layer(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run decoder layer `layer` (1-based), writing its keys and values into `cache` in place."""
        raise NotImplementedError

    def head(self, name: str, hidden: torch.Tensor) -> HeadOutput:
        """Run head `name` ("exit_{e}" or "final") on hidden [1, T, D]."""
        raise NotImplementedError

    def layer_exit(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, HeadOutput]:
        """Layer `layer` and its exit head on the last position, in one call (`layer_exit_{layer}`)."""
        raise NotImplementedError

    # checks --------------------------------------------------------------------------------
    def check_names(self, sub: Subgraph, inputs, outputs, what: str) -> None:
        """Compare a loaded graph's tensor names with the manifest's; report both differences as sets."""
        problems = []
        for kind, actual, expected in (
            ("inputs", set(inputs), set(sub.io.input_names)),
            ("outputs", set(outputs), set(sub.io.output_names)),
        ):
            missing, unexpected = expected - actual, actual - expected
            if missing or unexpected:
                problems.append(f"{kind}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        if problems:
            raise ManifestError(
                f"{what} for {sub.io.name} does not match the manifest ({'; '.join(problems)}). "
                "The export is inconsistent: re-export the model."
            )
