"""The TensorRT backend: the export's engines, run with `execute_async_v3` on torch CUDA tensors.

Written against the documented TensorRT 10.x / 11.x Python API and kept thin; it has not been run
(no TensorRT on the machines this project is developed on). One execution context per lane
stream, engine, optimization profile (decode T = 1, batched T = 2..K+1, prefill) and calling thread (a
model's engines decode on threads of their own at once, runtime/engine.py); every I/O
tensor is bound by address with `set_tensor_address`, a layer's `present_*` at its `past_*`
address (TensorRT's KV-cache update writes in place), and every enqueue's result is checked.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from paradecode.graphs.errors import ManifestError, MissingDependencyError, UserInputError
from paradecode.runtime.backends.base import Backend, Launched
from paradecode.runtime.loader import ExportFolder

try:
    import tensorrt as trt
except ImportError as err:  # backend_class turns this into an install hint
    raise ImportError(f"TensorRT is not installed: {err}") from err


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, export: ExportFolder, device: str = "cuda"):
        super().__init__(export, device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise UserInputError("the tensorrt backend runs on a CUDA GPU: use --device cuda on a machine with one.")
        info = self.manifest.tensorrt
        if not info or not all(s.engine for s in self.manifest.subgraphs):
            raise ManifestError(f"{export.path} has no TensorRT engines: re-export with --engine tensorrt.")
        props = torch.cuda.get_device_properties(self.device)
        here = f"{props.name} sm_{props.major}{props.minor}"
        if info["gpu"] != here or info["version"] != trt.__version__:
            raise ManifestError(
                f"the engines were built for {info['gpu']} with TensorRT {info['version']}; this is "
                f"{here} with TensorRT {trt.__version__}. Re-export with --engine tensorrt here."
            )
        self.token_ranges = [tuple(r) for r in info["token_ranges"]]
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engines = {}
        for sub in self.manifest.subgraphs:
            engine = self.runtime.deserialize_cuda_engine(export.read(sub.engine))
            if engine is None:
                raise ManifestError(f"TensorRT could not deserialize {sub.engine}; re-export with --engine tensorrt.")
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
            outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
            self.check_names(sub, inputs, outputs, f"the TensorRT engine {sub.engine}")
            self.engines[sub.io.name] = engine
        self.contexts: dict[tuple[str, str, int, int], object] = {}  # (subgraph, lane, profile, thread)

    def close(self) -> None:
        self.contexts.clear()
        self.engines.clear()

    def _profile(self, tokens: int) -> int:
        for index, (lo, _, hi) in enumerate(self.token_ranges):
            if lo <= tokens <= hi:
                return index
        raise UserInputError(f"a call of {tokens} tokens is outside every engine profile {self.token_ranges}.")

    def _launch(self, name: str, feeds: Mapping[str, torch.Tensor], lane: str) -> Launched:
        """Enqueue subgraph `name` on the lane's current CUDA stream, every tensor bound by address."""
        outputs = self.output_buffers(name, feeds)
        tokens = next(iter(feeds.values())).shape[1]
        stream = torch.cuda.current_stream(self.device)
        profile = self._profile(tokens)
        key = (name, lane, profile, threading.get_ident())
        context = self.contexts.get(key)
        if context is None:
            context = self.engines[name].create_execution_context()
            if not context.set_optimization_profile_async(profile, stream.cuda_stream):
                raise MissingDependencyError(f"TensorRT refused optimization profile {profile} for {name}.")
            self.contexts[key] = context
        for tensor_name, tensor in feeds.items():
            if not context.set_input_shape(tensor_name, tuple(tensor.shape)):
                raise UserInputError(
                    f"{name}: input {tensor_name} shape {tuple(tensor.shape)} is outside "
                    f"the engine's profile {profile} {self.token_ranges[profile]}."
                )
            context.set_tensor_address(tensor_name, tensor.data_ptr())
        for tensor_name, tensor in outputs.items():
            context.set_tensor_address(tensor_name, tensor.data_ptr())
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to enqueue {name} ({tokens} tokens)")
        return outputs, False
