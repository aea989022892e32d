"""Measured per-call costs of what a decode step runs, for the speed calibration (`cost.CostModel.measured`).

What is timed is what the runtime runs on a CPU: onnxruntime sessions (the runtime's session
options, calls through its own `Bound` IOBinding) of the export's subgraph graphs, traced from
`paradecode.graphs.modules` for the model's spec with weights of the right shapes (a dense call's
time does not depend on the values): one decoder layer at T = 1, 2 and MAX_TOKENS positions (the
batched calls; over LAYER_COPIES sessions in turn, since decoding cycles through every layer and
keeps none in the CPU's caches), an exit head over the reduced vocabulary, the final head at the same T, and the
embedding. The KV cache holds CONTEXT earlier positions, so attention reads a realistic length.
Calls are interleaved round by round after a warm-up and each cost is the median over the rounds:
on a shared CPU single timings are noisy.

Why not time the torch modules: torch's CPU matrix product for 2 or 3 rows (MKL) is 2-3x slower
than for 1 row, and than onnxruntime's; measured here on a SmolLM2 layer, a T = 2 call cost 2.9x a
T = 1 call in torch and 1.09x in onnxruntime, which would make batching look ruinous.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass

import torch

from paradecode.graphs.errors import MissingDependencyError
from paradecode.graphs.modules import EmbedGraph, HeadGraph, LayerGraph
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
    subgraph_io,
)

CONTEXT = 256  # positions already in the cache when a timed call runs (fewer where the model allows fewer)
MAX_TOKENS = 4  # the largest batched call timed (T = 1, 2 and this)
ROUNDS = 50
LAYER_COPIES = 8  # sessions the layer is timed over in turn: 8 SmolLM2 layers are 113 MB, past any CPU cache
WARMUP = 3
OPSET = 24


@dataclass(frozen=True)
class CallCosts:
    """Median seconds per call: layer and final head by the call's positions (T); exit head and embedding at T = 1."""

    layer: dict[int, float]
    exit_head: float
    final_head: dict[int, float]
    embed: float
    exit_vocab: int
    rounds: int
    threads: int
    context: int = CONTEXT

    def as_dict(self) -> dict:
        ms = lambda s: round(s * 1e3, 4)
        return {
            "backend": f"onnxruntime CPU, {self.threads} threads",
            "layer_ms": {str(t): ms(s) for t, s in self.layer.items()},
            "exit_head_ms": ms(self.exit_head),
            "exit_head_vocab": self.exit_vocab,
            "final_head_ms": {str(t): ms(s) for t, s in self.final_head.items()},
            "embed_ms": ms(self.embed),
            "rounds": self.rounds,
            "context": self.context,
        }


def onnx_from_graph_module(module: torch.nn.Module, io, spec: ModelSpec, capacity: int) -> bytes:
    """`module` traced to ONNX, serialized (sessions are made from it, one per copy)."""
    from paradecode.export.onnx_export import onnx_from_module

    model = onnx_from_module(
        module.eval(),
        io,
        vocab_size=spec.vocab_size,
        dtype=torch.float32,
        opset=OPSET,
        max_batch=1,
        max_seq_len=capacity,
    )
    return model.SerializeToString()


def session(model: bytes, threads: int):
    """An onnxruntime CPU session with the runtime's options."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def measure_call_costs(spec: ModelSpec, exit_vocab: int, *, rounds: int = ROUNDS) -> CallCosts:
    """Time each call of a decode step `rounds` times, interleaved; return the medians.

    Decoding runs every layer in turn, so no layer's weights stay in the CPU's caches from one call to its
    next: the layer is timed round-robin over LAYER_COPIES sessions of its own (each holding its weights),
    and the heads after them, as decoding reaches them.
    """
    try:
        from paradecode.runtime.backends.onnxruntime_backend import Bound
    except ImportError as err:
        raise MissingDependencyError(
            f"measuring call costs needs onnxruntime ({err}): `pip install paradecode[cpu]`, or pass "
            "--costs parameters to estimate them from parameter counts."
        ) from err
    from paradecode.export.config import ExportConfig

    torch.manual_seed(0)
    threads = max(1, os.cpu_count() or 1)
    context = min(CONTEXT, spec.max_position_embeddings - MAX_TOKENS)
    capacity = context + MAX_TOKENS
    full = [layer for layer in range(1, spec.num_layers + 1) if spec.window(layer) is None]
    layer = full[len(full) // 2] if full else max(1, spec.num_layers // 2)
    logits = next(f.default for f in dataclasses.fields(ExportConfig) if f.name == "with_logits")  # as exported
    common = dict(dtype="float32", max_seq_len=capacity)
    ios = {
        "layer": subgraph_io(spec, "layer", layer, **common),
        "exit": subgraph_io(
            spec, "exit", min(layer, spec.num_layers - 1), **common, with_logits=logits, head_vocab=exit_vocab
        ),
        "final": subgraph_io(spec, "final", **common, with_logits=logits),
        "embed": subgraph_io(spec, "embed", **common),
    }
    modules = {
        "layer": LayerGraph(spec, layer),
        "exit": HeadGraph(spec, transform=True, vocab=exit_vocab, with_logits=logits),
        "final": HeadGraph(spec, with_logits=logits),
        "embed": EmbedGraph(spec),
    }
    graphs = {kind: onnx_from_graph_module(modules[kind], ios[kind], spec, capacity) for kind in ios}
    copies = [session(graphs["layer"], threads) for _ in range(min(LAYER_COPIES, spec.num_layers))]
    heads = {kind: session(graphs[kind], threads) for kind in ("exit", "final", "embed")}
    cache = (1, spec.num_kv_heads, capacity, spec.head_dim)
    past_key, past_value = torch.randn(cache), torch.randn(cache)
    sizes = sorted({1, 2, MAX_TOKENS})
    hidden = {t: torch.randn(1, t, spec.hidden_size) for t in sizes}
    positions = {t: torch.arange(context, context + t).unsqueeze(0) for t in sizes}
    head_outputs = (TOKEN, PROB, MARGIN)  # what greedy decoding copies out (logits stay in the graph)

    calls: list[tuple[str, Bound, dict, tuple[str, ...]]] = []
    for t in sizes:
        feeds = {HIDDEN: hidden[t], POSITIONS: positions[t], PAST_KEY: past_key, PAST_VALUE: past_value}
        calls += [(f"layer{t}", Bound(copy, ios["layer"], t), feeds, (HIDDEN_OUT,)) for copy in copies]
        if t == 1:
            calls.append(("exit", Bound(heads["exit"], ios["exit"], 1), {HIDDEN: hidden[1]}, head_outputs))
        calls.append((f"final{t}", Bound(heads["final"], ios["final"], t), {HIDDEN: hidden[t]}, head_outputs))
    embed_feeds = {INPUT_IDS: torch.tensor([[1]])}
    if POSITIONS in ios["embed"].input_names:
        embed_feeds[POSITIONS] = positions[1]
    calls.append(("embed", Bound(heads["embed"], ios["embed"], 1), embed_feeds, (HIDDEN,)))
    times: dict[str, list[float]] = {name: [] for name, *_ in calls}
    for round_ in range(WARMUP + rounds):
        for name, call, feeds, wanted in calls:
            start = time.perf_counter()
            call(feeds, wanted)
            if round_ >= WARMUP:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    return CallCosts(
        layer={t: median[f"layer{t}"] for t in sizes},
        exit_head=median["exit"],
        final_head={t: median[f"final{t}"] for t in sizes},
        embed=median["embed"],
        exit_vocab=exit_vocab,
        rounds=rounds,
        threads=threads,
        context=context,
    )
