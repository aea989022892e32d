"""The onnxruntime backend: one InferenceSession per subgraph, shared by every lane.

`InferenceSession.run` releases the GIL and one session can run on several threads at once, so
lanes (threads) compute in parallel without a second copy of the weights. Every input and output
is bound with IOBinding to a torch tensor the runtime owns; a layer's `present_*` outputs are
bound to the very buffers passed as `past_*`, so the KV cache is written in place (TensorScatter
skips its copy when the two share memory). On a GPU (onnxruntime-gpu), tensors are bound by CUDA
address and each lane's stream gets its own session (`user_compute_stream`).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from paradecode.graphs.errors import ManifestError, MissingDependencyError, UserInputError
from paradecode.graphs.ops import TORCH_DTYPES
from paradecode.graphs.tensors import (
    HIDDEN,
    HIDDEN_OUT,
    INPUT_IDS,
    MARGIN,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
    PRESENT_KEY,
    PRESENT_VALUE,
    PROB,
    TOKEN,
)
from paradecode.runtime.backends.base import Backend, HeadOutput
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.loader import ExportFolder

try:
    import onnxruntime as ort
except ImportError as err:  # backend_class turns this into an install hint
    raise ImportError(f"onnxruntime is not installed: {err}") from err

NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}
BOUND_TOKENS = 16  # calls of up to this many tokens reuse a binding made once (see `Bound`)


def ort_value(tensor: torch.Tensor) -> ort.OrtValue:
    """An OrtValue sharing the memory of a contiguous CPU tensor."""
    if tensor.dtype == torch.bfloat16:
        from onnx import TensorProto

        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(tensor.view(torch.int16).numpy(), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(tensor.numpy())


class Bound:
    """An IOBinding with every tensor bound once, for one subgraph, token count and thread (CPU).

    Rebinding inputs costs more than a small layer's compute, so each call copies its inputs into
    persistent bound buffers and copies the outputs out; a layer's caches stay bound in place.
    """

    def __init__(self, session, io, tokens: int, caches: dict[str, ort.OrtValue]):
        self.binding = session.io_binding()
        self.session = session
        self.buffers: dict[str, np.ndarray] = {}
        for spec, output in [(t, False) for t in io.inputs] + [(t, True) for t in io.outputs]:
            if spec.name in caches:
                value = caches[spec.name]
            else:
                shape = tuple(1 if d == "batch" else tokens if d == "tokens" else d for d in spec.shape)
                self.buffers[spec.name] = buffer = np.zeros(shape, dtype=NUMPY_DTYPES[TORCH_DTYPES[spec.dtype]])
                value = ort.OrtValue.ortvalue_from_numpy(buffer)
            (self.binding.bind_ortvalue_output if output else self.binding.bind_ortvalue_input)(spec.name, value)
        self.outputs = [t.name for t in io.outputs if t.name not in caches]

    def __call__(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        for name, tensor in inputs.items():
            self.buffers[name][...] = tensor.numpy()
        self.session.run_with_iobinding(self.binding)
        return [torch.from_numpy(self.buffers[name].copy()) for name in self.outputs]


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, export: ExportFolder, device: str = "cpu", threads: int | None = None):
        super().__init__(export, device)
        providers = ort.get_available_providers()
        if self.device.type == "cuda" and "CUDAExecutionProvider" not in providers:
            raise MissingDependencyError(
                f"device 'cuda' needs onnxruntime-gpu; this onnxruntime offers {providers}. "
                "`pip uninstall onnxruntime && pip install paradecode[gpu]`."
            )
        if self.dtype == torch.bfloat16:
            raise UserInputError(
                "the onnxruntime backend does not run bfloat16 exports (no CPU kernels, no numpy "
                "type to bind): use --backend torch or tensorrt, or export float32/float16."
            )
        self.threads = threads if threads is not None else max(1, os.cpu_count() or 1)
        self.options = ort.SessionOptions()
        self.options.intra_op_num_threads = self.threads
        self.options.inter_op_num_threads = 1
        self.options.log_severity_level = 3
        # Idle pool threads must not spin: they would take the cores other lanes (or models) compute on.
        self.options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.sessions: dict[str, ort.InferenceSession] = {}
        self._stream_sessions: dict[tuple[str, int], ort.InferenceSession] = {}
        self._cache_values: dict[int, ort.OrtValue] = {}
        self._bound: dict[tuple[str, int, int, int], Bound] = {}
        for sub in self.manifest.subgraphs:
            session = self._create_session(sub.onnx)
            self.check_names(
                sub,
                [i.name for i in session.get_inputs()],
                [o.name for o in session.get_outputs()],
                f"the ONNX graph {sub.onnx}",
            )
            self.sessions[sub.io.name] = session

    def _create_session(self, relative: str, stream: int | None = None):
        path = self.export.file(relative)
        providers: list = ["CPUExecutionProvider"]
        if self.device.type == "cuda":
            cuda = {"device_id": self.device.index or 0}
            if stream is not None:
                cuda["user_compute_stream"] = str(stream)
            providers.insert(0, ("CUDAExecutionProvider", cuda))
        try:
            return ort.InferenceSession(str(path), self.options, providers=providers)
        except Exception as err:  # onnxruntime raises its own exception types
            raise ManifestError(
                f"onnxruntime cannot load {path} ({str(err).splitlines()[0]}); re-export the model."
            ) from err

    def close(self) -> None:
        self._bound.clear()
        self.sessions.clear()
        self._stream_sessions.clear()
        self._cache_values.clear()

    def allocate_cache(self) -> KVCache:
        self._cache_values.clear()
        self._bound.clear()
        return super().allocate_cache()

    def _bound_call(
        self, name: str, tokens: int, inputs: dict[str, torch.Tensor], caches: dict[str, torch.Tensor] | None = None
    ) -> list[torch.Tensor] | None:
        """Run through a persistent binding (CPU, small calls); None where the generic path applies."""
        if self.device.type != "cpu" or tokens > BOUND_TOKENS:
            return None
        cache_ptr = next(iter(caches.values())).data_ptr() if caches else 0  # a binding holds its cache
        key = (name, tokens, threading.get_ident(), cache_ptr)
        bound = self._bound.get(key)
        if bound is None:
            values = {k: self._cache_value(v) for k, v in (caches or {}).items()}
            bound = self._bound[key] = Bound(self.sessions[name], self.manifest.subgraph(name).io, tokens, values)
        return bound(inputs)

    def _cache_value(self, tensor: torch.Tensor):
        value = self._cache_values.get(tensor.data_ptr())
        if value is None:
            value = self._cache_values[tensor.data_ptr()] = ort_value(tensor)
        return value

    def _session(self, name: str):
        if self.device.type != "cuda":
            return self.sessions[name]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        key = (name, stream)
        if key not in self._stream_sessions:
            self._stream_sessions[key] = self._create_session(self.manifest.subgraph(name).onnx, stream)
        return self._stream_sessions[key]

    def _bind(self, binding, name: str, tensor: torch.Tensor, *, output: bool, cached: bool = False) -> None:
        if tensor.device.type == "cpu":
            value = self._cache_values.get(tensor.data_ptr()) if cached else None
            if value is None:
                value = ort_value(tensor)
                if cached:
                    self._cache_values[tensor.data_ptr()] = value
            (binding.bind_ortvalue_output if output else binding.bind_ortvalue_input)(name, value)
        else:
            args = (
                name,
                "cuda",
                tensor.device.index or 0,
                NUMPY_DTYPES[tensor.dtype],
                tuple(tensor.shape),
                tensor.data_ptr(),
            )
            (binding.bind_output if output else binding.bind_input)(*args)

    def _run(
        self, name: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], cached: tuple[str, ...] = ()
    ) -> None:
        session = self._session(name)
        binding = session.io_binding()
        for key, tensor in inputs.items():
            self._bind(binding, key, tensor, output=False, cached=key in cached)
        for key, tensor in outputs.items():
            self._bind(binding, key, tensor, output=True, cached=key in cached)
        session.run_with_iobinding(binding)

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inputs = {INPUT_IDS: ids.to(self.device).contiguous()}
        if self.spec.positions == "learned":
            inputs[POSITIONS] = positions.to(self.device).contiguous()
        fast = self._bound_call("embed", ids.shape[1], inputs)
        if fast is not None:
            return fast[0]
        hidden = torch.empty((*ids.shape, self.spec.hidden_size), dtype=self.dtype, device=self.device)
        self._run("embed", inputs, {HIDDEN: hidden})
        return hidden

    def layer(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        key, value = cache.layer(layer)
        fast = self._bound_call(
            f"layer_{layer}",
            hidden.shape[1],
            {HIDDEN: hidden, POSITIONS: positions},
            {PAST_KEY: key, PAST_VALUE: value, PRESENT_KEY: key, PRESENT_VALUE: value},
        )
        if fast is not None:
            return fast[0]
        out = torch.empty_like(hidden)
        self._run(
            f"layer_{layer}",
            {
                HIDDEN: hidden.contiguous(),
                POSITIONS: positions.to(self.device).contiguous(),
                PAST_KEY: key,
                PAST_VALUE: value,
            },
            {HIDDEN_OUT: out, PRESENT_KEY: key, PRESENT_VALUE: value},
            cached=(PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE),
        )
        return out

    def layer_exit(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache):
        name = f"layer_exit_{layer}"
        key, value = cache.layer(layer)
        caches = {PAST_KEY: key, PAST_VALUE: value, PRESENT_KEY: key, PRESENT_VALUE: value}
        fast = self._bound_call(name, hidden.shape[1], {HIDDEN: hidden, POSITIONS: positions}, caches)
        if fast is not None:
            return fast[0], HeadOutput.of(*fast[1:4])
        out = torch.empty_like(hidden)
        shape = (hidden.shape[0], 1)
        token = torch.empty(shape, dtype=torch.int64, device=self.device)
        prob = torch.empty(shape, dtype=torch.float32, device=self.device)
        margin = torch.empty(shape, dtype=torch.float32, device=self.device)
        self._run(
            name,
            {
                HIDDEN: hidden.contiguous(),
                POSITIONS: positions.to(self.device).contiguous(),
                PAST_KEY: key,
                PAST_VALUE: value,
            },
            {HIDDEN_OUT: out, PRESENT_KEY: key, PRESENT_VALUE: value, TOKEN: token, PROB: prob, MARGIN: margin},
            cached=tuple(caches),
        )
        return out, HeadOutput.of(token, prob, margin)

    def head(self, name: str, hidden: torch.Tensor) -> HeadOutput:
        fast = self._bound_call(name, hidden.shape[1], {HIDDEN: hidden})
        if fast is not None:
            return HeadOutput.of(*fast[:3])
        shape = hidden.shape[:2]
        token = torch.empty(shape, dtype=torch.int64, device=self.device)
        prob = torch.empty(shape, dtype=torch.float32, device=self.device)
        margin = torch.empty(shape, dtype=torch.float32, device=self.device)
        self._run(name, {HIDDEN: hidden.contiguous()}, {TOKEN: token, PROB: prob, MARGIN: margin})
        return HeadOutput.of(token, prob, margin)
