"""The torch backend: runs the `graphs` modules directly, on a CPU or a CUDA device.

It is the reference the other backends are compared with, and the GPU path where TensorRT is
absent. Weights come from the export's `weights.safetensors`, under the canonical names.

On CUDA, calls of up to GRAPH_TOKENS tokens run as CUDA graphs: each (subgraph, token count,
lane stream) is captured at its first use, from that very call's inputs (so the warm-up runs
before the capture write exactly the cache values the call itself writes), then replayed with
its inputs copied into static buffers. The KV cache has fixed addresses, which is what makes the
captured layer graphs valid for every later call. Each lane stream has its own memory pool, so
graphs replaying concurrently on two lanes never share intermediate buffers.
"""

from __future__ import annotations

import torch

from paradecode.graphs.errors import ManifestError, UserInputError
from paradecode.graphs.modules import build_subgraph
from paradecode.graphs.tensors import LOGITS, subgraph_io
from paradecode.runtime.backends.base import Backend, HeadOutput
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.loader import ExportFolder

GRAPH_TOKENS = 16  # calls of up to this many tokens are captured as CUDA graphs


class GraphedCall:
    """One subgraph call captured as a CUDA graph, for fixed input shapes."""

    def __init__(self, fn, inputs: list[torch.Tensor], pool):
        self.inputs = [x.clone() for x in inputs]
        stream = torch.cuda.current_stream()
        warmup = torch.cuda.Stream(device=stream.device)
        warmup.wait_stream(stream)
        with torch.cuda.stream(warmup):
            for _ in range(2):
                fn(*self.inputs)
        stream.wait_stream(warmup)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            out = fn(*self.inputs)
        self.outputs = out if isinstance(out, tuple) else (out,)

    def __call__(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        for static, value in zip(self.inputs, inputs):
            static.copy_(value, non_blocking=True)
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, export: ExportFolder, device: str = "cpu", cuda_graphs: bool = True):
        super().__init__(export, device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserInputError("device 'cuda' was asked for, but torch sees no CUDA GPU. Use --device cpu.")
        from safetensors.torch import load_file

        path = export.file(self.manifest.weights)
        try:
            weights = load_file(str(path), device=str(self.device))
        except Exception as err:  # safetensors raises its own error type for a damaged file
            raise ManifestError(f"cannot read {path} ({err}); re-export the model.") from err
        manifest = self.manifest
        self.modules: dict[str, torch.nn.Module] = {}
        for sub in manifest.subgraphs:
            with_logits = LOGITS in sub.io.output_names
            contract = subgraph_io(
                self.spec,
                sub.io.kind,
                sub.io.layer,
                dtype=manifest.dtype,
                max_seq_len=manifest.max_seq_len,
                max_batch=manifest.max_batch,
                with_logits=with_logits,
            )
            self.check_names(sub, contract.input_names, contract.output_names, "the torch module")
            self.modules[sub.io.name] = build_subgraph(
                self.spec, sub.io, weights, dtype=self.dtype, with_logits=with_logits
            ).to(self.device)
        self.layers = [self.modules[f"layer_{i}"] for i in range(1, self.spec.num_layers + 1)]
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[tuple, GraphedCall] = {}
        self.pools: dict[int, object] = {}

    def close(self) -> None:
        self.graphs.clear()
        self.pools.clear()
        self.modules.clear()
        self.layers = []

    def allocate_cache(self) -> KVCache:
        self.graphs.clear()  # captured layers point at the old buffers
        return super().allocate_cache()

    def _call(self, key: str, fn, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run `fn(*inputs)`: as a CUDA graph where enabled and the call is small, else directly."""
        tokens = inputs[0].shape[1]
        if not self.cuda_graphs or tokens > GRAPH_TOKENS:
            out = fn(*inputs)
            return out if isinstance(out, tuple) else (out,)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        graph = self.graphs.get((key, tokens, stream))
        if graph is None:
            pool = self.pools.setdefault(stream, torch.cuda.graph_pool_handle())
            graph = self.graphs[(key, tokens, stream)] = GraphedCall(fn, inputs, pool)
        return graph(inputs)

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device, non_blocking=True)
        if self.spec.positions == "learned":
            return self._call("embed", self.modules["embed"], [ids, positions.to(self.device, non_blocking=True)])[0]
        return self._call("embed", self.modules["embed"], [ids])[0]

    @torch.inference_mode()
    def layer(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        key, value = cache.layer(layer)
        module = self.layers[layer - 1]
        return self._call(
            f"layer_{layer}",
            lambda h, p: module(h, p, key, value)[0],
            [hidden, positions.to(self.device, non_blocking=True)],
        )[0]

    @torch.inference_mode()
    def layer_exit(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache):
        key, value = cache.layer(layer)
        name = f"layer_exit_{layer}"
        module = self.modules[name]

        def run(h, p):
            out = module(h, p, key, value)
            return out[0], out[3], out[4], out[5]

        hidden, token, prob, margin = self._call(name, run, [hidden, positions.to(self.device, non_blocking=True)])
        return hidden, HeadOutput.of(token, prob, margin)

    @torch.inference_mode()
    def head(self, name: str, hidden: torch.Tensor) -> HeadOutput:
        token, prob, margin = self._call(name, lambda h: self.modules[name](h)[:3], [hidden])
        return HeadOutput.of(token, prob, margin)
