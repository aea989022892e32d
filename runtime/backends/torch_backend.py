"""The torch backend: runs the `graphs` modules directly, on a CPU or a CUDA device.

It is the reference the other backends are compared with, and the GPU path where TensorRT is
absent. Weights come from the export's `weights.safetensors`, under the canonical names; quantized
ones are dequantized on load (graphs/quantized_weights.py), so they are held in float, except that with `int4_kernels`
the 4-bit ones are read as 4-bit values by torch's int4 kernels (int4_kernels.py), and then the backend's row form
is probed as the onnxruntime backend's is on a CPU (runtime/row_exactness.py says why).

On CUDA, calls of up to GRAPH_TOKENS tokens run as CUDA graphs: each (subgraph, token count, lane)
is captured at its first use, from that very call's inputs (so the warm-up runs before the capture
write exactly the cache values the call itself writes), then replayed with its inputs copied into
static buffers. The KV cache has fixed addresses, which is what makes the captured layer graphs
valid for every later call. Each lane has its own memory pool, so graphs replaying concurrently on
two lanes never share intermediate buffers; captures are serialised by a lock (a capture must not
overlap another lane's capture).

With `torch_compile`, every subgraph module goes through torch.compile (Inductor fuses the many small
kernels of a layer: norms, rotary, the mask, softmax, the cache write), and CUDA graphs, where on, capture
the compiled call. A call's token and batch dimensions are marked dynamic, so a module compiles a few times
(one token and several; one row and several; inputs that are views at other offsets) rather than once per
shape; the first call of each pays for the compilation (seconds per module on a GPU), which
`ParaDecodeModel.warm_up` moves to load time for the calls it makes. Compiled modules read the whole KV
cache, masked, as CUDA does (a length read from the positions is a shape Inductor cannot plan for), so their
caches start at 0 (`reads_whole_cache`).

What Inductor compiles is kept on disk and reused by later processes (its FX graph and AOTAutograd caches,
and the kernels they point to), so a second run of the same export traces with dynamo but compiles nothing
again: `use_compile_cache` points Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, which Inductor otherwise
puts under /tmp, emptied at reboot) at ~/.cache/paradecode/inductor unless the user set it. The compiled
graphs hold no weights (dynamo passes a module's parameters as inputs) nor anything else of one process, so a
graph of the same shapes, dtype and device hits the cache (tests/runtime/test_torch_compile.py checks it on a CPU).

Threads and compiled modules: lanes (and a server's replicas) call the same compiled code from several
threads. Compilation itself is serialised by dynamo's own lock, and a CUDA graph's warm-up calls (where a
shape compiles) run under the capture lock; PyTorch does not document torch.compile as thread-safe beyond
that. What was checked: compiled decoding in every overlap, side lanes included, gives plain decoding's
tokens (tests/runtime/test_torch_compile.py on a CPU; tests/runtime/test_gpu.py on an H100).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from paradecode.graphs.cache_dir import user_cache
from paradecode.graphs.errors import ManifestError, ParadecodeError, UserInputError
from paradecode.graphs.modules import build_subgraph, subgraph_state
from paradecode.graphs.quantized_weights import QuantizedWeight, dequantized
from paradecode.graphs.tensors import LOGITS, subgraph_io
from paradecode.runtime.backends.base import Backend, Launched
from paradecode.runtime.backends.int4_kernels import Int4Kernels, unavailable
from paradecode.runtime.loader import ExportFolder

logger = logging.getLogger(__name__)
GRAPH_TOKENS = 16  # calls of up to this many tokens are captured as CUDA graphs
# torch.compile recompiles a module's code for each new set of guards (shapes, strides, dispatch keys), counted over
# every module of one class (30 layers share theirs); at dynamo's limit (8 by default) a module compiled with
# fullgraph=True raises. Token counts and batch sizes are marked dynamic, so a few entries per class suffice (up to
# 5 seen for the layers: one and several tokens, one and several rows, views at other offsets); the limit is raised
# to this, process-wide (dynamo has no per-module limit), and reaching it is reported as a ParadecodeError.
RECOMPILE_LIMIT = 64


INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def default_compile_cache() -> Path:
    """Where Inductor's caches go unless TORCHINDUCTOR_CACHE_DIR says otherwise: paradecode's user cache
    (`$XDG_CACHE_HOME/paradecode/inductor`, ~/.cache by default)."""
    return user_cache("inductor")


def use_compile_cache() -> Path:
    """Inductor's cache folder for this process: TORCHINDUCTOR_CACHE_DIR where the user set it, else
    `default_compile_cache()`, set in the environment, where Inductor reads it (process-wide, as Inductor's own
    setting is), before anything compiles.

    Inductor writes its own default (a folder under the temporary directory) into the environment at its first
    use, which may precede this (tracing for an export in the same process does): that value is taken as unset.
    Inductor reads the variable again wherever it reads or writes its caches, so what compiles from here on goes
    to the new folder (measured: tests/runtime/test_torch_compile.py, and a process that exports then compiles).
    """
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch internal: where it moves, Inductor's documented default (tmp/torchinductor_USER)

        def default_cache_dir() -> str:
            import getpass
            import tempfile

            return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")

    folder = os.environ.get(INDUCTOR_CACHE_VARIABLE)
    if folder is None or os.path.abspath(folder) == os.path.abspath(default_cache_dir()):
        folder = os.environ[INDUCTOR_CACHE_VARIABLE] = str(default_compile_cache())
    _say_where(folder)
    return Path(folder)


@functools.cache
def _say_where(folder: str) -> None:  # once per process and folder, however many models load
    logger.info("torch_compile: Inductor caches what it compiles in %s (%s)", folder, INDUCTOR_CACHE_VARIABLE)


def compile_cache_counts() -> dict[str, int]:
    """This process's hits and misses of Inductor's FX graph cache and of the AOTAutograd cache so far (from dynamo's
    counters, a torch internal)."""
    from torch._dynamo.utils import counters

    return {
        "fx_graph_hits": counters["inductor"].get("fxgraph_cache_hit", 0),
        "fx_graph_misses": counters["inductor"].get("fxgraph_cache_miss", 0),
        "aot_autograd_hits": counters["aot_autograd"].get("autograd_cache_hit", 0),
        "aot_autograd_misses": counters["aot_autograd"].get("autograd_cache_miss", 0),
    }


def compiled(module: torch.nn.Module) -> Callable:
    """`module` through torch.compile, whole (a graph break is an error, not a slow path)."""
    import torch._dynamo

    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name before torch 2.7
    if getattr(config, limit) < RECOMPILE_LIMIT:
        logger.info("torch_compile: dynamo's %s raised from %d to %d", limit, getattr(config, limit), RECOMPILE_LIMIT)
        setattr(config, limit, RECOMPILE_LIMIT)
    return torch.compile(module, fullgraph=True)


def check_compiler(device: torch.device) -> None:
    """torch.compile on a CPU generates C++: refuse at load, not at the first call, where no compiler is found."""
    import shutil

    if device.type == "cpu" and not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        raise UserInputError(
            "torch_compile on a CPU needs a C++ compiler (g++, c++ or clang++), and none is on the PATH: install one "
            "(apt install g++), or load without torch_compile (--compile)."
        )


def plain(t: torch.Tensor) -> bool:
    """A contiguous inference tensor that starts its storage: what a compiled module's inputs are made into."""
    return t.is_inference() and t.is_contiguous() and t.storage_offset() == 0


def mark_dynamic(streamed: tuple[torch.Tensor, ...], caches: Iterable[torch.Tensor]) -> None:
    """Mark the batch dimension of every input, and the token dimension of the streamed ones (hidden states, token
    ids, positions: [B, T, ...]), dynamic where it is above 1, so other counts reuse the compiled code."""
    from torch._dynamo import maybe_mark_dynamic

    for t in streamed:
        for dim in (0, 1)[: t.dim()]:
            if t.shape[dim] > 1:
                maybe_mark_dynamic(t, dim)
    for t in caches:
        if t.shape[0] > 1:
            maybe_mark_dynamic(t, 0)


class GraphedCall:
    """One subgraph call captured as a CUDA graph, for fixed input shapes."""

    def __init__(self, fn: Callable, inputs: list[torch.Tensor], pool):
        self.inputs = [x.clone() for x in inputs]
        # CUDA refuses a capture on the legacy default stream, which the main lane runs on: warm up and
        # capture on a private stream ordered after the lane's work, then let the lane wait for it.
        # Replays run on whichever stream is current at the call (the lane's).
        stream = torch.cuda.current_stream()
        capture = torch.cuda.Stream(device=stream.device)
        capture.wait_stream(stream)
        with torch.cuda.stream(capture):
            for _ in range(2):
                fn(*self.inputs)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=capture, capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs)
        stream.wait_stream(capture)

    def __call__(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        for static, value in zip(self.inputs, inputs):
            static.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs  # static buffers, overwritten by the next replay: `Backend.run` copies out what it returns


class TorchBackend(Backend):
    name = "torch"

    def __init__(
        self,
        export: ExportFolder,
        device: str = "cpu",
        cuda_graphs: bool = True,
        torch_compile: bool = False,
        int4_kernels: bool = False,
    ):
        """`int4_kernels`: 4-bit weights read by torch's int4 kernels (int4_kernels.py) rather than dequantized."""
        super().__init__(export, device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserInputError("device 'cuda' was asked for, but torch sees no CUDA GPU. Use --device cpu.")
        from safetensors.torch import load

        try:  # read into memory, never mapped (runtime/watched.py)
            weights = {k: v.to(self.device) for k, v in load(export.read(self.manifest.weights)).items()}
        except Exception as err:  # safetensors raises its own error type for a damaged file
            raise ManifestError(f"cannot read {self.manifest.weights} ({err}); re-export the model.") from err
        self._exit_vocab_weights = weights.get("exits.vocab")  # the one tensor decoding asks for (`weights_tensor`)
        manifest = self.manifest
        quantized = self._int4_weights(weights, int4_kernels)
        # Quantized weights run dequantized (to float32, then the export's dtype): the reference their
        # onnxruntime graphs were validated against.
        weights = dequantized(weights, manifest.quantization)
        self.int4 = Int4Kernels(quantized, weights, self.dtype, self.device) if int4_kernels else None
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
                last=sub.io.last,
            )
            self.check_names(sub, contract.input_names, contract.output_names, "the torch module")
            module = build_subgraph(self.spec, sub.io, weights, dtype=self.dtype, with_logits=with_logits)
            if self.int4 is not None:
                self.int4.apply(module, subgraph_state(self.spec, sub.io, weights))
            self.modules[sub.io.name] = module.to(self.device)
        if self.int4 is not None:
            self.int4.finish()
        self.torch_compile = torch_compile
        self.reads_whole_cache = torch_compile or self.device.type != "cpu"  # compiled: graphs/ops.py, attention
        self.compile_cache: Path | None = None  # Inductor's cache folder, with torch_compile
        if torch_compile:
            check_compiler(self.device)
            self.compile_cache = use_compile_cache()
            self.modules = {name: compiled(module) for name, module in self.modules.items()}
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        # (subgraph, batch, tokens, lane, the caches' addresses): a graph writes the very caches it was captured with
        self.graphs: dict[tuple, GraphedCall] = {}
        self.pools: dict[str, object] = {}  # lane -> CUDA graph memory pool
        self._capture = threading.Lock()

    def kernels_identity(self) -> str:
        """torch's version, the device (a GPU's name and CUDA's version; a CPU's threads), compilation, CUDA graphs and
        the weights int4 kernels read: what a position's bits depend on here."""
        if self.device.type == "cuda":
            where = f"{torch.cuda.get_device_name(self.device)}, CUDA {torch.version.cuda}"
        else:
            where = f"CPU, {torch.get_num_threads()} threads"
        int4 = sorted(self.int4.replaced) if self.int4 is not None else []
        return (
            f"torch {torch.__version__}, {where}, compiled {self.torch_compile}, CUDA graphs {self.cuda_graphs}, "
            f"int4 kernels on {int4}"
        )

    @property
    def probes_rows(self) -> bool:
        """Probed where int4 kernels read some weights (module docstring); elsewhere `AS_IS`."""
        return self.int4 is not None and bool(self.int4.replaced)

    def _int4_weights(self, stored: dict[str, torch.Tensor], wanted: bool) -> dict[str, QuantizedWeight]:
        """The quantized weights int4 kernels are to read (none unless `wanted`)."""
        quantization = self.manifest.quantization
        if not isinstance(wanted, bool):
            raise UserInputError(f"int4_kernels must be True or False, got {wanted!r}.")
        if not wanted or quantization is None:
            return {}
        reason = unavailable(self.device, self.dtype)
        if reason is not None:
            raise UserInputError(f"int4_kernels was asked for, but {reason}. Leave int4_kernels off.")
        return {name: QuantizedWeight.from_stored(name, fmt, stored) for name, fmt in quantization.weights.items()}

    def weights_tensor(self, name: str) -> torch.Tensor:
        if name == "exits.vocab" and self._exit_vocab_weights is not None:
            return self._exit_vocab_weights.cpu()
        return super().weights_tensor(name)

    def close(self) -> None:
        self.graphs.clear()
        self.pools.clear()
        self.modules.clear()

    def allocate_cache(self, batch: int = 1):
        self.graphs.clear()  # captured layers point at the old buffers
        return super().allocate_cache(batch)

    @torch.inference_mode()
    def _launch(self, name: str, feeds: Mapping[str, torch.Tensor], lane: str) -> Launched:
        """The subgraph's module on the feeds; the caches it writes in place are closed over, never copied."""
        call = self.calls[name]
        module = self.modules[name]
        streamed, order = call.streamed, call.input_order
        cached = {n: feeds[n] for n in call.in_place.values()}  # fixed buffers: closed over, never copied

        def run(*inputs):
            full = dict(zip(streamed, inputs))
            full.update(cached)
            if not self.torch_compile:
                out = module(*[full[n] for n in order])
            else:
                # Views at other offsets or strides, and tensors made outside inference mode, are other guards to
                # dynamo: one fresh contiguous inference tensor each (a few KB) keeps them to one compilation.
                full.update((n, t if plain(t) else t.clone()) for n, t in zip(streamed, inputs))
                mark_dynamic(tuple(full[n] for n in streamed), cached.values())
                try:
                    out = module(*[full[n] for n in order])
                except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                    raise ParadecodeError(
                        f"torch.compile reached its limit of {RECOMPILE_LIMIT} compilations of one module class at "
                        f"{name} ({tuple(inputs[0].shape)}): load without torch_compile, or report the call."
                    ) from err
            out = out if isinstance(out, tuple) else (out,)
            return tuple(t for n, t in zip(call.outputs, out) if n not in call.in_place)

        where = tuple(t.data_ptr() for t in cached.values())
        computed, reused = self._call(name, lane, run, [feeds[n] for n in streamed], where)
        return dict(zip(call.produced, computed)), reused

    def _call(
        self, name: str, lane: str, fn: Callable, inputs: list[torch.Tensor], where: tuple[int, ...] = ()
    ) -> tuple[tuple[torch.Tensor, ...], bool]:
        """`fn(*inputs)`: as a CUDA graph where enabled and the call is small (its outputs are then the graph's
        static buffers, reused by its next replay), else directly. `where`: the addresses of the caches `fn`
        writes (one graph per cache: a batch's rows are views of one buffer at other addresses)."""
        batch, tokens = inputs[0].shape[:2]
        if not self.cuda_graphs or tokens > GRAPH_TOKENS:
            return fn(*inputs), False
        key = (name, batch, tokens, lane, where)
        graph = self.graphs.get(key)
        if graph is None:
            with self._capture:
                pool = self.pools.setdefault(lane, torch.cuda.graph_pool_handle())
                graph = self.graphs[key] = GraphedCall(fn, inputs, pool)
        return graph(inputs), True
