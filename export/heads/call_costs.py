"""What the calls of a decode step cost on this machine: one measurement, over graphs from one of two sources.

`measure_call_costs(backend, cache, tokens)` times the calls through the runtime's own backend
(`Backend.run`, as decoding makes them): one decoder layer at each T in `tokens` (cycling over every
layer graph, as decoding does, so no layer's weights stay in the CPU's caches), the exit head at T = 1
(the final head where the export has no exit graph), the final head at each T, and the embedding. The
KV cache holds CONTEXT earlier positions, so attention reads a realistic length. The calls are
interleaved round by round after WARMUP rounds, and each cost is the median over the rounds: on a shared
CPU single timings are noisy. On a GPU every call is waited for, or only its launch would be timed.

The graphs come from:

- an export: the loaded model's backend, on its device (`paradecode-bench`'s bound), or an export
  folder loaded here on this CPU (`call_costs_of_export`: `paradecode-train-heads --costs FOLDER`
  calibrates on a quantized export's own costs);
- a model's spec, before any export exists (`paradecode-train-heads` calibrates the thresholds the export
  then takes in): `call_costs_from_spec` traces the spec's subgraph modules (`graphs.modules`) to ONNX with
  weights of the right shapes (a dense call's time does not depend on the values), LAYER_COPIES copies of
  one layer, an exit head over the reduced vocabulary, the final head and the embedding
  (`graphs_from_spec`), and times them with the onnxruntime backend on this CPU, as the CPU runtime runs
  them.

Why not time the torch modules there: torch's CPU matrix product for 2 or 3 rows (MKL) is 2-3x slower
than for 1 row, and than onnxruntime's; measured here on a SmolLM2 layer, a T = 2 call cost 2.9x a
T = 1 call in torch and 1.09x in onnxruntime, which would make batching look ruinous.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from paradecode.graphs.errors import ManifestError, MissingDependencyError, UserInputError
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import (
    HIDDEN,
    HIDDEN_OUT,
    INPUT_IDS,
    MARGIN,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
    PROB,
    TOKEN,
)
from paradecode.runtime.row_exactness import AS_IS

CONTEXT = 256  # positions already in the cache when a timed call runs (fewer where the cache holds fewer)
SPEC_TOKENS = (1, 2, 4)  # the calls of a spec's graphs are timed at these T (the calibration's merge: T = 2)
ROUNDS = 50
LAYER_COPIES = 8  # a spec's layer is timed over this many copies in turn: 8 SmolLM2 layers are 113 MB
WARMUP = 3
OPSET = 24
HEAD_OUTPUTS = (TOKEN, PROB, MARGIN)  # what greedy decoding copies out of a head (logits stay in the graph)


@dataclass(frozen=True)
class CallCosts:
    """Median seconds per call: layer and final head by the call's positions (T); exit head and embedding at T = 1."""

    layer: dict[int, float]
    exit_head: float
    final_head: dict[int, float]
    embed: float
    exit_vocab: int  # the exit head's vocabulary
    rounds: int
    backend: str  # what ran the calls
    context: int = CONTEXT

    def as_dict(self) -> dict:
        ms = lambda s: round(s * 1e3, 4)
        return {
            "backend": self.backend,
            "layer_ms": {str(t): ms(s) for t, s in self.layer.items()},
            "exit_head_ms": ms(self.exit_head),
            "exit_head_vocab": self.exit_vocab,
            "final_head_ms": {str(t): ms(s) for t, s in self.final_head.items()},
            "embed_ms": ms(self.embed),
            "rounds": self.rounds,
            "context": self.context,
        }


def described(backend) -> str:
    """What runs the calls, for the record: "onnxruntime CPU, threads: 2", "torch cuda:0"."""
    where = "CPU" if backend.device.type == "cpu" else str(backend.device)
    threads = getattr(backend, "threads", None)  # onnxruntime: threads per call
    if not threads:
        return f"{backend.name} {where}"
    return f"{backend.name} {where}, threads: {threads}"


def measure_call_costs(backend, cache, tokens: Sequence[int], *, rounds: int = ROUNDS) -> CallCosts:
    """Time each call of a decode step `rounds` times through `backend.run`, interleaved; return the medians.

    `cache`: the KV cache the layers write into (the model's own, or one of the backend's making); the
    timed calls write positions CONTEXT.. of it, which decoding masks until it reaches them.
    """
    manifest, spec = backend.manifest, backend.spec
    sizes = sorted({1, *tokens})
    # each call as the runtime makes it on this machine: a call of T positions runs as `rows(T)` rows (copies of
    # its last position after it: runtime/row_exactness.py); its cost is what T positions cost
    form = backend.row_form or AS_IS
    rows = form.rows  # a form of positions `alone`: one row a call, T of them for T positions (timed once, times T)
    context = min(CONTEXT, cache.capacity - sizes[-1])
    cache.reserve(context + rows(sizes[-1]))  # a cache as long as decoding at that context has (runtime/kvcache.py)
    layers = [(s.io.name, s.io.layer) for s in manifest.subgraphs if s.io.kind == "layer"]
    exit_head = next((s.io.name for s in manifest.subgraphs if s.io.kind == "exit"), "final")
    exit_vocab = manifest.head_vocab if exit_head != "final" and manifest.head_vocab else spec.vocab_size
    generator = torch.Generator().manual_seed(0)
    # hidden states in the export's dtype, as decoding feeds them
    hidden = {
        t: (torch.randn(1, rows(t), spec.hidden_size, generator=generator) * 0.1).to(backend.dtype) for t in sizes
    }
    positions = {t: torch.arange(context, context + rows(t))[None] for t in sizes}
    calls: list[tuple[str, int, str, dict, tuple[str, ...]]] = []  # (kind, T, subgraph, feeds, outputs)
    for t in sizes:
        for name, layer in layers:
            key, value = cache.layer(layer)
            feeds = {HIDDEN: hidden[t], POSITIONS: positions[t], PAST_KEY: key, PAST_VALUE: value}
            calls.append(("layer", t, name, feeds, (HIDDEN_OUT,)))
        if t == 1:
            calls.append(("exit", 1, exit_head, {HIDDEN: hidden[1]}, HEAD_OUTPUTS))
        calls.append(("final", t, "final", {HIDDEN: hidden[t]}, HEAD_OUTPUTS))
    embed_feeds = {INPUT_IDS: torch.tensor([[1]])}
    if POSITIONS in backend.subgraphs["embed"].io.input_names:
        embed_feeds[POSITIONS] = positions[1][:, :1]
    calls.append(("embed", 1, "embed", embed_feeds, (HIDDEN,)))
    settle = torch.cuda.synchronize if backend.device.type == "cuda" else None
    times: dict[tuple[str, int], list[float]] = {(kind, t): [] for kind, t, *_ in calls}
    for round_ in range(WARMUP + rounds):
        for kind, t, name, feeds, outputs in calls:
            if settle:
                settle()
            start = time.perf_counter()
            backend.run(name, feeds, "main", outputs)
            if settle:
                settle()
            if round_ >= WARMUP:
                times[kind, t].append((time.perf_counter() - start) * (t if form.alone else 1))
    median = {key: statistics.median(values) for key, values in times.items()}
    return CallCosts(
        layer={t: median["layer", t] for t in sizes},
        exit_head=median["exit", 1],
        final_head={t: median["final", t] for t in sizes},
        embed=median["embed", 1],
        exit_vocab=exit_vocab,
        rounds=rounds,
        backend=described(backend),
        context=context,
    )


def exported_layer(spec: ModelSpec, layer: int, capacity: int):
    """Layer `layer` as an export's graph computes it (fused operators), with random weights and real rotary
    tables of `capacity` positions."""
    from paradecode.graphs.modules import LayerGraph
    from paradecode.graphs.ops import rope_caches

    module = LayerGraph(spec, layer, ops="fused", max_seq_len=capacity)
    if spec.positions == "rope":
        half = spec.head_dim // 2
        module.inv_freq.copy_(1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half)))
        module.cos_cache, module.sin_cache = rope_caches(module.inv_freq, 1.0, capacity, torch.float32)
    return module


def graphs_from_spec(spec: ModelSpec, exit_vocab: int, folder: Path):
    """The graphs a decode step runs, for `spec` with random weights, written into `folder` as an export the
    runtime opens (`runtime.loader.ExportFolder`): LAYER_COPIES copies of one full-attention layer from the
    middle (`layer_1`..), an exit head over `exit_vocab` tokens, the final head and the embedding, with logits
    where an export has them by default; float32, the cache CONTEXT + the largest SPEC_TOKENS positions long."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.onnx_export import onnx_from_module
    from paradecode.graphs.manifest import FileRecord, Manifest, Subgraph
    from paradecode.graphs.modules import EmbedGraph, HeadGraph
    from paradecode.graphs.tensors import subgraph_io
    from paradecode.runtime.loader import ExportFolder

    torch.manual_seed(0)
    capacity = min(CONTEXT, spec.max_position_embeddings - max(SPEC_TOKENS)) + max(SPEC_TOKENS)
    full = [layer for layer in range(1, spec.num_layers + 1) if spec.window(layer) is None]
    layer = full[len(full) // 2] if full else max(1, spec.num_layers // 2)
    exit_layer = min(layer, spec.num_layers - 1)
    logits = next(f.default for f in dataclasses.fields(ExportConfig) if f.name == "with_logits")  # as exported
    common = dict(dtype="float32", max_seq_len=capacity)
    traced = {  # graph name -> (its contract, its module)
        f"layer_{layer}": (subgraph_io(spec, "layer", layer, **common), exported_layer(spec, layer, capacity)),
        f"exit_{exit_layer}": (
            subgraph_io(spec, "exit", exit_layer, **common, with_logits=logits, head_vocab=exit_vocab),
            HeadGraph(spec, transform=True, vocab=exit_vocab, with_logits=logits),
        ),
        "final": (subgraph_io(spec, "final", **common, with_logits=logits), HeadGraph(spec, with_logits=logits)),
        "embed": (subgraph_io(spec, "embed", **common), EmbedGraph(spec)),
    }
    count = min(LAYER_COPIES, spec.num_layers)
    copies = {f"layer_{layer}": [subgraph_io(spec, "layer", i, **common) for i in range(1, count + 1)]}
    (folder / "onnx").mkdir(parents=True, exist_ok=True)
    subgraphs, files = [], {}
    for name, (io, module) in traced.items():
        model = onnx_from_module(
            module.eval(), io, vocab_size=spec.vocab_size, dtype=torch.float32, opset=OPSET, max_batch=1,
            max_seq_len=capacity,
        )  # fmt: skip
        for copy in copies.get(name, [io]):
            model.graph.name = copy.name  # the backend checks each graph is the subgraph it is listed as
            relative = f"onnx/{copy.name}.onnx"
            (folder / relative).write_bytes(model.SerializeToString())
            files[relative] = FileRecord.of(folder / relative)
            subgraphs.append(Subgraph(copy, relative))
    manifest = Manifest(
        model={"timing": "random weights of the spec's shapes"},
        spec=spec,
        dtype="float32",
        max_seq_len=capacity,
        max_batch=1,
        max_unverified=max(SPEC_TOKENS) - 1,
        opset=OPSET,
        exit_layers=(exit_layer,),
        head_kind="trained",
        thresholds={},
        subgraphs=tuple(subgraphs),
        files=files,
        head_vocab=exit_vocab,
    )
    return ExportFolder(folder, manifest)


def call_costs_from_spec(spec: ModelSpec, exit_vocab: int, *, rounds: int = ROUNDS) -> CallCosts:
    """`measure_call_costs` over `graphs_from_spec`'s graphs, with the onnxruntime backend on this CPU (the
    runtime's defaults: every core per call), at SPEC_TOKENS."""
    from paradecode.runtime.backends import backend_class

    try:
        backend_type = backend_class("onnxruntime")
    except MissingDependencyError as err:
        raise MissingDependencyError(
            f"measuring call costs needs onnxruntime ({err}): `pip install paradecode[cpu]`, or pass "
            "--costs parameters to estimate them from parameter counts."
        ) from err
    with tempfile.TemporaryDirectory(prefix="paradecode-timing-") as tmp:
        backend = backend_type(graphs_from_spec(spec, exit_vocab, Path(tmp)), device="cpu")
        with backend:
            cache = backend.allocate_cache()
            cache.reserve(cache.shape[2])
            for layer in range(1, cache.num_layers + 1):  # earlier positions hold values, as while decoding
                for buffer in cache.layer(layer):
                    buffer.normal_()
            return measure_call_costs(backend, cache, SPEC_TOKENS, rounds=rounds)


def check_costs_export(folder: Path, identity: dict, spec: ModelSpec, exit_vocab: int) -> dict:
    """Refuse an export whose calls are not those of the heads being trained (another model's, one without
    exit-head graphs, one whose exit heads read another vocabulary size, one onnxruntime cannot run here);
    return what the heads file records of it. `identity`: the model's (`ModelSource.identity`)."""
    from paradecode.export.heads.vocab import head_parameters, layer_parameters
    from paradecode.graphs.manifest import read_manifest

    where = f"--costs {folder}"
    try:
        manifest = read_manifest(folder)
    except ManifestError as err:
        raise UserInputError(f"{where}: {err} (with --heads: its exit heads are timed too)") from err
    theirs = manifest.model.get("weights_sha256")
    if theirs != identity["weights_sha256"]:
        raise UserInputError(
            f"{where}: the export is of another model ({manifest.model.get('source')!r}, weights sha256 "
            f"{str(theirs)[:12]}...) than {identity['source']!r} (sha256 {identity['weights_sha256'][:12]}...). "
            "Time an export of this model, or pass --costs measured."
        )
    if not any(s.io.kind == "exit" for s in manifest.subgraphs):
        raise UserInputError(
            f"{where}: the export has no exit-head graphs (it was exported without --heads), so an exit head's call "
            "cannot be timed there. Export it with --heads (any heads file of this model, such as one trained with "
            "--costs measured), or pass --costs measured."
        )
    theirs = manifest.head_vocab or manifest.spec.vocab_size
    if theirs != exit_vocab:
        budget = (head_parameters(spec, theirs) + spec.hidden_size / 2) / layer_parameters(spec)  # mid-interval
        raise UserInputError(
            f"{where}: the export's exit heads read {theirs} tokens, these heads {exit_vocab}, so their calls cost "
            f"differently. Train heads of the export's size with --head-budget {budget:.6f}, or pass --costs measured."
        )
    if manifest.dtype == "bfloat16":
        raise UserInputError(
            f"{where}: the export computes in bfloat16, which onnxruntime cannot run on a CPU, where the costs are "
            "timed. Time a float32 export of this model, or pass --costs measured."
        )
    activations = manifest.quantization.activations if manifest.quantization else None
    return {"export": folder.name, "dtype": manifest.dtype, "activations": activations, "ops": manifest.ops}


def call_costs_from_export(folder: Path, *, rounds: int = ROUNDS) -> CallCosts:
    """`measure_call_costs` over the graphs of the export in `folder` (checked by `check_costs_export`), loaded
    by the runtime with onnxruntime on this CPU with its defaults, at SPEC_TOKENS: its own weights, quantization
    and operators."""
    from paradecode.runtime import load

    try:
        model = load(folder, backend="onnxruntime", device="cpu")
    except MissingDependencyError as err:
        raise MissingDependencyError(
            f"timing the export {folder} needs onnxruntime ({err}): `pip install paradecode[cpu]`, or pass "
            "--costs parameters."
        ) from err
    with model:
        return measure_call_costs(model.backend, model.backend.allocate_cache(), SPEC_TOKENS, rounds=rounds)
