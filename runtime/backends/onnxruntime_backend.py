"""The onnxruntime backend: one InferenceSession per subgraph, shared by every lane (threads per call: see THREADS).

`InferenceSession.run` releases the GIL and one session can run on several threads at once, so
lanes (threads) compute in parallel without a second copy of the weights. Inputs and outputs are
bound with IOBinding; a layer's `present_*` outputs are bound to the very buffers fed as `past_*`,
so the KV cache is written in place (TensorScatter skips its copy when the two share memory).

Sessions are made from the export's files as read into memory at load (the graphs and the weights file, which
`weights` holds for the model's life: a session made later, at a subgraph's first call, is made from them too);
onnxruntime copies each session's initializers from those bytes and maps no file (runtime/watched.py says why).

On a CPU, small calls (up to BOUND_TOKENS tokens, which is every decode step) reuse a binding made
once per (subgraph, batch, token count, lane) and calling thread: rebinding costs more than a small layer's
compute, and a binding's buffers are one call's at a time (engines of one model decode on threads of their own at
once; a thread's bindings are freed with it). On a GPU
(onnxruntime-gpu), tensors are bound by CUDA address and each lane gets its own session on its own
stream (`user_compute_stream`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import PurePosixPath

import numpy as np
import torch

from paradecode.graphs.errors import ManifestError, MissingDependencyError, UserInputError
from paradecode.graphs.ops import TORCH_DTYPES
from paradecode.graphs.ortvalues import ort_value
from paradecode.runtime import policy, row_exactness
from paradecode.runtime.backends.base import Backend, Launched
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.loader import ExportFolder
from paradecode.runtime.safetensors_bytes import tensor_from_safetensors

try:
    import onnxruntime as ort
except ImportError as err:  # backend_class turns this into an install hint
    raise ImportError(f"onnxruntime is not installed: {err}") from err

logger = logging.getLogger(__name__)

NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}
MMAP_THRESHOLD = 256 << 10  # see `return_freed_weights_to_the_system`
BOUND_TOKENS = 16  # calls of up to this many tokens reuse a binding made once (see `Bound`)
# THREADS. Each session has a pool of `threads` threads (every core by default: runtime/policy.py's "onnxruntime
# threads per call" row, measured), whose threads spin between a call's operators and stop spinning when the call
# ends (`session.force_spinning_stop`). A token is some 300 to 1,000 small operators in six calls: a pool whose idle
# threads sleep pays a wake-up per operator, more than a small product gains from a second thread (the layers had run
# on one thread for that), and pools that keep spinning after their call take the cores from the next call's pool
# (0.63x, tools/results/cpu-2core/position-costs.md). Calls that compute at once on several threads (the `streams`
# and `both` overlaps, a server's replicas) spin on each other's cores unless their threads add up to the cores: the
# server shares the cores out so (runtime/serve/config.py), and ParaDecode's side lanes make their calls and lane
# 0's inside `sharing(lanes)`, which runs them through sessions of `threads // lanes` threads (made at their first
# such call: a second pre-packed copy of those graphs' weights; on pools of every core the overlaps ran at under
# half of ar's speed, tools/results/cpu-2core/thread-pools.md), once the machine is found to give a position the
# same bits on that share as on every thread (runtime/row_exactness.py's `shares_exactly`; else every thread). Not
# used: onnxruntime's global thread pools, one pool for every session of the process, within noise of this here
# (tools/results/cpu-2core/thread-pools.md), because once a process has them every onnxruntime session it makes must
# use them, the caller's own included: a library cannot impose that on the process that loads it.


def return_freed_weights_to_the_system() -> None:
    """Fix glibc's mmap threshold, so that large freed blocks go back to the system.

    onnxruntime reads each weight, pre-packs it for its matrix kernels and frees the unpacked copy.
    glibc raises its mmap threshold each time such a block is freed, so later weights land in the
    heap, and the freed copies stay there as holes the process still holds: measured on SmolLM2-135M
    (538 MB of weights), 635 MB of anonymous memory for its sessions, against 538 MB with a fixed
    threshold. A no-op where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version"):
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD; setting it also stops the dynamic adjustment


class Bound:
    """An IOBinding made once for one subgraph, batch size, token count and lane (CPU).

    Each call copies its inputs into persistent bound buffers and returns the output buffers, which
    `Backend.run` copies out (the ones asked for); the in-place buffers (the caches) stay bound where
    they are, and are rebound only if a call feeds other ones. They are bound by address, holding no reference: a
    binding that held its cache's buffers (an OrtValue over them) kept every cache a batch shape had last run with
    alive after the cache grew or its engine ended, which is how a server's idle memory grew by hundreds of MB per
    round of long prompts (issue 52: 1,265 -> 2,135 MB over 5 rounds). A freed buffer's address is never run on:
    every call feeds its caches, and one fed at another address or shape is bound again before the run.
    """

    def __init__(self, session, io, batch: int, tokens: int):
        self.session = session
        self.binding = session.io_binding()
        self.buffers: dict[str, np.ndarray] = {}
        self.in_place = io.in_place  # output -> input
        self.bound: dict[str, tuple] = {}  # in-place input -> (data_ptr, shape) it is bound to
        for spec in io.inputs:
            if spec.name not in self.in_place.values():
                self._buffer(spec, batch, tokens, self.binding.bind_ortvalue_input)
        for spec in io.outputs:
            if spec.name not in self.in_place:
                self._buffer(spec, batch, tokens, self.binding.bind_ortvalue_output)
        # the output buffers as tensors, made once: what every call returns (reused, so `run` copies them out)
        self.outputs = {n: torch.from_numpy(self.buffers[n]) for n in io.output_names if n not in self.in_place}

    def _buffer(self, spec, batch: int, tokens: int, bind) -> None:
        buffer = np.zeros(spec.concrete(batch, tokens), dtype=NUMPY_DTYPES[TORCH_DTYPES[spec.dtype]])
        self.buffers[spec.name] = buffer
        bind(spec.name, ort.OrtValue.ortvalue_from_numpy(buffer))

    def __call__(self, feeds: Mapping[str, torch.Tensor]) -> Launched:
        for output, source in self.in_place.items():
            tensor = feeds[source]
            # by address and shape: a cache that shrank may get a freed buffer's address back at another size
            where = (tensor.data_ptr(), tuple(tensor.shape))
            if self.bound.get(source) != where:
                dtype, address = NUMPY_DTYPES[tensor.dtype], tensor.data_ptr()
                self.binding.bind_input(source, "cpu", 0, dtype, where[1], address)
                self.binding.bind_output(output, "cpu", 0, dtype, where[1], address)
                self.bound[source] = where
        for name, tensor in feeds.items():
            if name in self.buffers:
                self.buffers[name][...] = tensor.numpy()
        self.session.run_with_iobinding(self.binding)
        return self.outputs, True


class Bindings(dict):
    """One thread's `Bound`s by (subgraph, batch, tokens, lane, threads) (a dict that a WeakSet can hold: by
    identity)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    grows_cache = True  # its graphs take a cache of any length: attention costs what the cache holds

    @property
    def probes_rows(self) -> bool:
        """On a CPU, the CPU engine, whose quantized kernels choose their code path by row count."""
        return self.device.type == "cpu"

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
        self.reads_whole_cache = True  # its graphs attend over every slot of the cache they are given, masked
        return_freed_weights_to_the_system()
        # The export's files in this process's memory, never mapped: sessions are made from these bytes, at load or
        # at a subgraph's first call, whatever the folder holds by then (runtime/watched.py). No weights file where the
        # graphs hold their initializers (export/heads/call_costs.py's): then no graph may read any from a file.
        weights = self.manifest.weights if self.manifest.weights in self.manifest.files else None
        self.weights = export.read(weights) if weights else None
        self.graphs = {sub.onnx: export.read(sub.onnx) for sub in self.manifest.subgraphs}
        self._weights_names = {PurePosixPath(weights).name} if weights else set()  # the graphs' external data location
        self.threads = threads or policy.onnxruntime_threads(max(1, os.cpu_count() or 1))  # per call: see THREADS
        self.options = self._options()
        self.sessions: dict[str, ort.InferenceSession] = {}  # CPU: created on a subgraph's first call
        # CPU: (subgraph, threads) -> the session for calls made while several lanes compute at once (`sharing`)
        self._sharing_sessions: dict[tuple[str, int], ort.InferenceSession] = {}
        self._lane_sessions: dict[tuple[str, str], ort.InferenceSession] = {}  # GPU: (subgraph, lane)
        # CPU: each calling thread's bindings, (subgraph, batch, tokens, lane, threads) -> Bound: engines of one model
        # decode on threads of their own at once, and a thread's bindings go with it (`_bindings` only sees live ones)
        self._local = threading.local()
        self._bindings: weakref.WeakSet[Bindings] = weakref.WeakSet()
        self._creating = threading.Lock()  # sessions are created by whichever lane calls first
        self._exact_shares: dict[int, bool] = {}  # threads -> whether calls on them give all threads' bits (set once)
        self._share_probe = threading.Lock()  # held while a share is probed (row_exactness.shares_exactly)
        # A call of many positions (a prefill) gives back the memory it took beyond the session's arena's first
        # block when it ends: each session's arena would otherwise keep the largest prompt's peak for good.
        self._release_peak = ort.RunOptions()
        self._release_peak.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        for sub in self.manifest.subgraphs:
            self._check_graph(sub)
        self._check_rotary_tables()

    def _options(self, threads: int | None = None):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = threads or self.threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")  # within a call alone: see THREADS
        options.add_session_config_entry("session.force_spinning_stop", "1")
        if self.weights is not None and not hasattr(options, "add_external_initializers_from_files_in_memory"):
            raise MissingDependencyError(
                f"onnxruntime {ort.__version__} cannot take an export's weights from memory (its SessionOptions lack "
                "add_external_initializers_from_files_in_memory, added in 1.24): `pip install 'onnxruntime>=1.24'` "
                "(or onnxruntime-gpu)."
            )
        if self.weights is not None:  # from memory: onnxruntime copies a session's initializers as it creates it
            names, weights = list(self._weights_names), [self.weights]
            options.add_external_initializers_from_files_in_memory(names, weights, [len(self.weights)])
        return options

    def _check_graph(self, sub) -> None:
        """The ONNX file's graph name, inputs, outputs and external data against the manifest (its nodes read, not
        its weights): every initializer kept outside the graph must be in the export's weights file.

        Sessions are created at a subgraph's first call, so only the graphs a decoding mode uses hold weights
        in memory: plain decoding and `batched` ParaDecode run the segments (graphs/tensors.py), not the layer
        graphs they are made of; the layer graphs load where a side lane or a range without a segment needs one.
        """
        import onnx

        try:
            graph = onnx.load_model_from_string(self.graphs[sub.onnx]).graph
        except Exception as err:  # onnx raises protobuf's DecodeError and its own errors
            raise ManifestError(
                f"onnx cannot read {sub.onnx} ({str(err).splitlines()[0]}); re-export the model."
            ) from err
        outside = {
            entry.value
            for tensor in graph.initializer
            if tensor.data_location == onnx.TensorProto.EXTERNAL
            for entry in tensor.external_data
            if entry.key == "location"
        }
        if outside - self._weights_names:
            raise ManifestError(
                f"{sub.onnx} reads initializers from {sorted(outside)}; an export's graphs read them from its weights "
                f"file {self.manifest.weights} alone. The export is inconsistent: re-export the model."
            )
        self.check_names(
            sub, [i.name for i in graph.input], [o.name for o in graph.output], f"the ONNX graph {sub.onnx}"
        )
        if graph.name != sub.io.name:  # another subgraph's file at this one's path, its hash updated
            raise ManifestError(
                f"{sub.onnx} holds the graph {graph.name!r}, expected {sub.io.name!r}. The export is inconsistent: "
                "re-export the model."
            )

    def _check_rotary_tables(self) -> None:
        """The layer graphs' rotary tables (export/attention.py) must cover the manifest's max_seq_len positions, which
        the manifest alone cannot tell: a larger one would fail at the first call past the tables."""
        if self.spec.positions != "rope" or self.weights is None:
            return
        expected = (self.manifest.max_seq_len, self.spec.rotary_dims // 2)
        for name in [f"{table}.{part}" for table in self.spec.rope_tables for part in ("cos", "sin")]:
            shape = tuple(self.weights_tensor(name).shape)
            if shape != expected:
                raise ManifestError(
                    f"{self.manifest.weights}: {name} holds rotary tables of {shape[0]} positions ({list(shape)}), "
                    f"and the manifest's limits.max_seq_len is {expected[0]} (tables {list(expected)} expected). "
                    "The export is inconsistent: re-export the model."
                )

    def _cpu_session(self, name: str, threads: int):
        """The subgraph's session for calls of `threads` threads (see THREADS), made at its first such call."""
        sessions, key = (self.sessions, name) if threads == self.threads else (self._sharing_sessions, (name, threads))
        session = sessions.get(key)
        if session is None:
            with self._creating:
                session = sessions.get(key)
                if session is None:
                    options = self.options if threads == self.threads else self._options(threads)
                    session = sessions[key] = self._create_session(self.subgraphs[name].onnx, options=options)
        return session

    def sharing(self, lanes: int):
        """The calling thread's calls on `threads // lanes` threads, where calls on so few give every position the
        bits calls on every thread give (row_exactness.shares_exactly, checked at the first such call on a machine);
        else on every thread, as plain decoding's."""
        share = max(1, self.threads // lanes)
        if share != self.threads and self.device.type == "cpu":
            exact = self._exact_shares.get(share)
            if exact is None:
                with self._share_probe:  # one thread probes; another asking for the same share waits for it
                    exact = self._exact_shares.get(share)
                    if exact is None:
                        exact = self._exact_shares[share] = self._shares_exactly(share)
            share = share if exact else self.threads
        return self.calls_on(share)

    def _shares_exactly(self, share: int) -> bool:
        """row_exactness.shares_exactly, once per share; a check that fails (memory, say) counts as inexact: the
        lanes then keep every thread, as plain decoding's calls run. An inexact share's sessions are freed, with the
        calling thread's bindings to them (the check made its calls on this thread)."""
        try:
            exact = row_exactness.shares_exactly(self, share)
        except Exception as err:  # onnxruntime raises its own exception types
            logger.warning(
                "%s: checking calls on %d of %d threads failed (%s): lanes computing at once keep every thread",
                self.export.path.name,
                share,
                self.threads,
                str(err).splitlines()[0] if str(err) else type(err).__name__,
            )
            exact = False
        if not exact:
            with self._creating:
                for key in [k for k in self._sharing_sessions if k[1] == share]:
                    del self._sharing_sessions[key]
            bindings = getattr(self._local, "bindings", None) or {}
            for key in [k for k in bindings if k[4] == share]:
                del bindings[key]
        return exact

    @contextlib.contextmanager
    def calls_on(self, threads: int):
        """The calling thread's calls inside it on sessions of `threads` threads (made at their first such call)."""
        before = getattr(self._local, "threads", None)
        self._local.threads = threads
        try:
            yield
        finally:
            self._local.threads = before

    def _call_threads(self) -> int:
        """Threads for the calling thread's next call: its share where lanes compute at once (`sharing`)."""
        return getattr(self._local, "threads", None) or self.threads

    def _create_session(self, relative: str, stream: int | None = None, options=None):
        providers: list = ["CPUExecutionProvider"]
        if self.device.type == "cuda":
            cuda = {"device_id": self.device.index or 0}
            if stream is not None:
                cuda["user_compute_stream"] = str(stream)
            providers.insert(0, ("CUDAExecutionProvider", cuda))
        try:
            return ort.InferenceSession(self.graphs[relative], options or self.options, providers=providers)
        except Exception as err:  # onnxruntime raises its own exception types
            raise ManifestError(
                f"onnxruntime cannot load {relative} ({str(err).splitlines()[0]}); re-export the model."
            ) from err

    def weights_tensor(self, name: str) -> torch.Tensor:
        if self.weights is None:
            return super().weights_tensor(name)
        return tensor_from_safetensors(self.weights, name, self.manifest.weights)

    def open_subgraphs(self) -> set[str]:
        shared = {name for name, _ in self._sharing_sessions}
        return set(self.sessions) | shared | {name for name, _ in self._lane_sessions}

    def close_subgraphs(self, names) -> None:
        """Drop the subgraphs' sessions and bindings; their weights go with them."""
        names = set(names)
        with self._creating:
            for key in [k for k in self.sessions if k in names]:
                del self.sessions[key]
            for key in [k for k in self._sharing_sessions if k[0] in names]:
                del self._sharing_sessions[key]
            for key in [k for k in self._lane_sessions if k[0] in names]:
                del self._lane_sessions[key]
            for bindings in list(self._bindings):
                for key in [k for k in list(bindings) if k[0] in names]:
                    bindings.pop(key, None)

    def close(self) -> None:
        self._forget_bindings()
        self.sessions.clear()
        self._sharing_sessions.clear()
        self._lane_sessions.clear()

    def allocate_cache(self, batch: int = 1) -> KVCache:
        self.row_form  # noqa: B018 (asked first: the probe's calls bind the probe's own cache)
        self._forget_bindings()
        return super().allocate_cache(batch)

    def _launch(self, name: str, feeds: Mapping[str, torch.Tensor], lane: str) -> Launched:
        """On a CPU, a call of up to BOUND_TOKENS tokens through its lane's persistent binding (`Bound`), one per
        calling thread (engines of one model decode at once on threads of their own); any other call binds the given
        tensors and new output buffers (by CUDA address on a GPU)."""
        batch, tokens = next(iter(feeds.values())).shape[:2]
        if self.device.type == "cpu" and tokens <= BOUND_TOKENS:
            bindings = getattr(self._local, "bindings", None)
            if bindings is None:
                bindings = self._local.bindings = Bindings()
                self._bindings.add(bindings)
            threads = self._call_threads()
            key = (name, batch, tokens, lane, threads)
            bound = bindings.get(key)
            if bound is None:
                session = self._cpu_session(name, threads)
                bound = bindings[key] = Bound(session, self.subgraphs[name].io, batch, tokens)
            return bound(feeds)
        feeds = {k: v.contiguous() for k, v in feeds.items()}  # bound by address, kept alive until the run
        result = self.output_buffers(name, feeds)
        session = self._session(name, lane)
        binding = session.io_binding()
        for key, tensor in feeds.items():
            self._bind(binding.bind_ortvalue_input, binding.bind_input, key, tensor)
        for key, tensor in result.items():
            self._bind(binding.bind_ortvalue_output, binding.bind_output, key, tensor)
        session.run_with_iobinding(binding, self._release_peak if self.device.type == "cpu" else None)
        return result, False

    def _forget_bindings(self) -> None:
        for bindings in list(self._bindings):
            bindings.clear()

    def _session(self, name: str, lane: str):
        """The CPU session, or on a GPU this lane's own session on its CUDA stream."""
        if self.device.type != "cuda":
            return self._cpu_session(name, self._call_threads())
        key = (name, lane)
        if key not in self._lane_sessions:
            stream = torch.cuda.current_stream(self.device).cuda_stream
            self._lane_sessions[key] = self._create_session(self.subgraphs[name].onnx, stream)
        return self._lane_sessions[key]

    def _bind(self, bind_value, bind_address, name: str, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            bind_value(name, ort_value(tensor))
        else:
            dtype = NUMPY_DTYPES[tensor.dtype]
            bind_address(name, "cuda", tensor.device.index or 0, dtype, tuple(tensor.shape), tensor.data_ptr())
