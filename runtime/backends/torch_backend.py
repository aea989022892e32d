"""The torch backend: runs the `graphs` modules directly, on a CPU or a CUDA device.

It is the reference the other backends are compared with, and the GPU path where TensorRT is
absent. Weights come from the export's `weights.safetensors`, under the canonical names.
"""

from __future__ import annotations

import torch

from paradecode.graphs.errors import ManifestError, UserInputError
from paradecode.graphs.modules import build_subgraph
from paradecode.graphs.tensors import LOGITS, subgraph_io
from paradecode.runtime.backends.base import Backend, HeadOutput
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.loader import ExportFolder


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, export: ExportFolder, device: str = "cpu"):
        super().__init__(export, device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserInputError("device 'cuda' was asked for, but torch sees no CUDA GPU. Use --device cpu.")
        from safetensors.torch import load_file

        path = export.path / self.manifest.weights
        try:
            weights = load_file(str(path), device=str(self.device))
        except Exception as err:  # safetensors raises its own error type for a damaged file
            raise ManifestError(f"cannot read {path} ({err}); re-export the model.") from err
        manifest = self.manifest
        self.modules: dict[str, torch.nn.Module] = {}
        for sub in manifest.subgraphs:
            with_logits = LOGITS in sub.io.output_names
            contract = subgraph_io(self.spec, sub.io.kind, sub.io.layer, dtype=manifest.dtype,
                                   max_seq_len=manifest.max_seq_len, max_batch=manifest.max_batch,
                                   with_logits=with_logits)
            self.check_names(sub, contract.input_names, contract.output_names, "the torch module")
            self.modules[sub.io.name] = build_subgraph(self.spec, sub.io, weights, dtype=self.dtype,
                                                       with_logits=with_logits).to(self.device)
        self.layers = [self.modules[f"layer_{i}"] for i in range(1, self.spec.num_layers + 1)]

    def close(self) -> None:
        self.modules.clear()
        self.layers = []

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        if self.spec.positions == "learned":
            return self.modules["embed"](ids, positions.to(self.device))
        return self.modules["embed"](ids)

    @torch.inference_mode()
    def layer(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        key, value = cache.layer(layer)
        return self.layers[layer - 1](hidden, positions.to(self.device), key, value)[0]

    @torch.inference_mode()
    def head(self, name: str, hidden: torch.Tensor) -> HeadOutput:
        token, prob, margin = self.modules[name](hidden)[:3]
        return HeadOutput.of(token, prob, margin)
