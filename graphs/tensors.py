"""The one place that names every subgraph and every tensor crossing a subgraph boundary.

Subgraphs (docs/design.md §4), with layers numbered 1..L:

- ``embed``: ``input_ids`` [B, T] int64 (+ ``positions`` [B, T] for learned positions)
  -> ``hidden`` [B, T, D]
- ``layer_i``: ``hidden`` [B, T, D], ``positions`` [B, T], ``past_key`` / ``past_value``
  [B, H_kv, S, D_h] -> ``hidden_out``, ``present_key``, ``present_value``. The caches are
  written in place at slots ``positions[b, 0] .. positions[b, 0] + T - 1`` (the write index is
  derived from the positions inside the graph); a query attends over every slot of the cache it is
  given, masked by the positions (a slot at or before its own, within a sliding window). S, the
  cache's slots, is up to the export's max_seq_len: the runtime may give a cache that holds what
  the sequence needs so far and grow it (runtime/kvcache.py), since attention costs what it reads.
- ``exit_e`` (after layer e) and ``final``: ``hidden`` [B, T, D] -> ``token`` [B, T] int64 (top-1),
  ``prob`` [B, T] float32 (its probability), ``margin`` [B, T] float32 (top-1 minus top-2 logit),
  and optionally ``logits`` [B, T, V]. A trained exit head may predict over a reduced vocabulary of
  N tokens (its ``token`` is still a model token id; its ``logits`` are [B, T, N]); exit layers without
  trained heads have no graph of their own: their head is ``final``.
- ``layer_exit_e``: layer e and exit head e fused, for the newest token's call at an exit layer: the
  inputs and outputs of ``layer_e`` plus ``token``, ``prob``, ``margin`` [B, 1] of the exit head on
  the last position. One call instead of two where per-call cost matters.
- ``draft`` (an export made with a draft head, export/draft_head.py): ``hidden`` [B, T, D], the last layer's
  output at positions p - 1 (what the final head reads), ``embedded`` [B, T, D], the embedding of tokens[p] (the
  ``embed`` graph's output), ``positions`` [B, T] (p), and the draft's own ``past_key`` / ``past_value`` (one layer's,
  written in place as a layer's) -> ``hidden_out`` [B, T, D] (the draft's guess at the last layer's output at p, its
  next call's ``hidden``), the caches, and ``token``, ``prob``, ``margin`` [B, T]: its top-1 guess at tokens[p + 1]
  over its reduced vocabulary (a model token id), as a head's.
- ``draft_reduce`` (a draft head that reads three layers' outputs, EAGLE-3's fusion): ``features`` [B, T, 3D], the
  outputs of a low, a middle and the last layer at positions p - 1 side by side (the manifest's
  ``draft.feature_layers`` name the first two) -> ``hidden`` [B, T, D], what the ``draft`` graph's first call over
  those positions reads in place of the last layer's output (its later calls read its own ``hidden_out``).
- ``segment_a_b``: layers a..b in one graph, an execution unit beside the per-layer graphs (the
  contract's unit): ``hidden``, ``positions`` and each layer's ``past_key.i`` / ``past_value.i`` ->
  ``hidden_out`` and each layer's ``present_key.i`` / ``present_value.i`` (written in place, as a
  layer's). An export's segments partition 1..L at its exit layers (and a draft head's feature layers), so a token
  moves through a few calls instead of one per layer.

Symbolic dimensions are named ``batch``, ``tokens`` and ``slots``; everything else is fixed at export. ``batch`` is
symbolic in an export made with ``--max-batch`` 2 or more: rows are independent requests (runtime/engine.py), each at
its own positions, so each row's cache length is its own, and every row of a call carries the same number of tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from paradecode.graphs.spec import ModelSpec

BATCH = "batch"
TOKENS = "tokens"
SLOTS = "slots"  # a KV cache's slots: up to the export's max_seq_len

INPUT_IDS = "input_ids"
EMBEDDED = "embedded"
FEATURES = "features"
POSITIONS = "positions"
HIDDEN = "hidden"
HIDDEN_OUT = "hidden_out"
PAST_KEY = "past_key"
PAST_VALUE = "past_value"
PRESENT_KEY = "present_key"
PRESENT_VALUE = "present_value"
TOKEN = "token"
PROB = "prob"
MARGIN = "margin"
LOGITS = "logits"

# A layer writes its new keys and values into the cache buffers it is fed: each of these outputs is
# the very buffer fed as the named input (bound to the same memory by every backend). A segment's
# per-layer caches are named `past_key.{i}` / `present_key.{i}`: `SubgraphIO.in_place` pairs them all.
IN_PLACE = {PRESENT_KEY: PAST_KEY, PRESENT_VALUE: PAST_VALUE}

DTYPES = ("float32", "float16", "bfloat16")
KINDS = ("embed", "layer", "exit", "final", "layer_exit", "segment", "draft", "draft_reduce")
HEAD_SUBGRAPHS = ("exit", "final")  # the kinds that are a head alone (layer_exit holds a layer too)


def of_layer(name: str, layer: int) -> str:
    """A segment's name for layer `layer`'s tensor `name` (`past_key` -> `past_key.3`)."""
    return f"{name}.{layer}"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str, ...]
    dtype: str

    def concrete(self, batch: int, tokens: int, slots: int | None = None) -> tuple[int, ...]:
        """The shape with its symbolic dimensions (`batch`, `tokens`, a cache's `slots`) given values: the one place
        that substitutes them."""
        values = {BATCH: batch, TOKENS: tokens, SLOTS: slots}
        if SLOTS in self.shape and slots is None:
            raise ValueError(f"{self.name} has a symbolic number of slots {list(self.shape)}: give `slots`")
        return tuple(values.get(d, d) if isinstance(d, str) else d for d in self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorSpec:
        return cls(data["name"], tuple(data["shape"]), data["dtype"])


@dataclass(frozen=True)
class SubgraphIO:
    """Name, kind and tensor contract of one subgraph."""

    name: str
    kind: str
    layer: int | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    last: int | None = None  # a segment's last layer (`layer` is its first)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def in_place(self) -> dict[str, str]:
        """Each output that is the very buffer fed as an input (a layer's caches), output -> input."""
        inputs = set(self.input_names)
        pairs = {}
        for name in self.output_names:
            base, dot, layer = name.partition(".")
            source = IN_PLACE.get(base)
            if source is not None and (source + dot + layer) in inputs:
                pairs[name] = source + dot + layer
        return pairs


def subgraph_name(kind: str, layer: int | None = None, last: int | None = None) -> str:
    if kind == "segment":
        return f"segment_{layer}_{last}"
    if kind in ("embed", "final", "draft", "draft_reduce"):
        return kind
    if kind == "layer":
        return f"layer_{layer}"
    if kind == "exit":
        return f"exit_{layer}"
    if kind == "layer_exit":
        return f"layer_exit_{layer}"
    raise ValueError(f"unknown subgraph kind {kind!r}; expected one of {KINDS}")


def subgraph_io(
    spec: ModelSpec,
    kind: str,
    layer: int | None = None,
    *,
    dtype: str,
    max_seq_len: int,
    max_batch: int = 1,
    with_logits: bool = False,
    head_vocab: int | None = None,
    last: int | None = None,
) -> SubgraphIO:
    """The tensor contract of one subgraph. `dtype` is the dtype of hidden states and caches.

    `head_vocab`: the size of the exit heads' reduced vocabulary (their logits' last dimension), None
    when exit heads predict over the whole vocabulary. `last`: a segment's last layer (`layer` its first).
    """
    batch: int | str = 1 if max_batch == 1 else BATCH
    tokens = TOKENS
    hidden = TensorSpec(HIDDEN, (batch, tokens, spec.hidden_size), dtype)
    positions = TensorSpec(POSITIONS, (batch, tokens), "int64")
    if kind == "embed":
        inputs = [TensorSpec(INPUT_IDS, (batch, tokens), "int64")]
        if spec.positions == "learned":
            inputs.append(positions)
        outputs = [hidden]
    elif kind in ("layer", "layer_exit"):
        if layer is None or not 1 <= layer <= spec.num_layers:
            raise ValueError(f"layer must be in 1..{spec.num_layers}, got {layer}")
        if kind == "layer_exit" and layer == spec.num_layers:
            raise ValueError(f"an exit head sits after a layer in 1..{spec.num_layers - 1}, got {layer}")
        cache = (batch, spec.num_kv_heads, SLOTS, spec.head_dim)
        inputs = [hidden, positions, TensorSpec(PAST_KEY, cache, dtype), TensorSpec(PAST_VALUE, cache, dtype)]
        outputs = [
            TensorSpec(HIDDEN_OUT, hidden.shape, dtype),
            TensorSpec(PRESENT_KEY, cache, dtype),
            TensorSpec(PRESENT_VALUE, cache, dtype),
        ]
        if kind == "layer_exit":
            outputs += [
                TensorSpec(TOKEN, (batch, 1), "int64"),
                TensorSpec(PROB, (batch, 1), "float32"),
                TensorSpec(MARGIN, (batch, 1), "float32"),
            ]
    elif kind == "segment":
        if layer is None or last is None or not 1 <= layer <= last <= spec.num_layers:
            raise ValueError(f"a segment spans layers first..last within 1..{spec.num_layers}, got {layer}..{last}")
        cache = (batch, spec.num_kv_heads, SLOTS, spec.head_dim)
        layers = range(layer, last + 1)
        inputs = [hidden, positions]
        inputs += [TensorSpec(of_layer(n, i), cache, dtype) for i in layers for n in (PAST_KEY, PAST_VALUE)]
        outputs = [TensorSpec(HIDDEN_OUT, hidden.shape, dtype)]
        outputs += [TensorSpec(of_layer(n, i), cache, dtype) for i in layers for n in (PRESENT_KEY, PRESENT_VALUE)]
    elif kind == "draft":
        cache = (batch, spec.num_kv_heads, SLOTS, spec.head_dim)
        inputs = [
            hidden,
            TensorSpec(EMBEDDED, hidden.shape, dtype),
            positions,
            TensorSpec(PAST_KEY, cache, dtype),
            TensorSpec(PAST_VALUE, cache, dtype),
        ]
        outputs = [
            TensorSpec(HIDDEN_OUT, hidden.shape, dtype),
            TensorSpec(PRESENT_KEY, cache, dtype),
            TensorSpec(PRESENT_VALUE, cache, dtype),
            TensorSpec(TOKEN, (batch, tokens), "int64"),
            TensorSpec(PROB, (batch, tokens), "float32"),
            TensorSpec(MARGIN, (batch, tokens), "float32"),
        ]
    elif kind == "draft_reduce":
        inputs = [TensorSpec(FEATURES, (batch, tokens, 3 * spec.hidden_size), dtype)]
        outputs = [hidden]
    elif kind in ("exit", "final"):
        if kind == "exit" and (layer is None or not 1 <= layer < spec.num_layers):
            raise ValueError(f"an exit head sits after a layer in 1..{spec.num_layers - 1}, got {layer}")
        inputs = [hidden]
        outputs = [
            TensorSpec(TOKEN, (batch, tokens), "int64"),
            TensorSpec(PROB, (batch, tokens), "float32"),
            TensorSpec(MARGIN, (batch, tokens), "float32"),
        ]
        if with_logits:
            vocab = head_vocab if kind == "exit" and head_vocab is not None else spec.vocab_size
            outputs.append(TensorSpec(LOGITS, (batch, tokens, vocab), dtype))
    else:
        raise ValueError(f"unknown subgraph kind {kind!r}; expected one of {KINDS}")
    return SubgraphIO(
        subgraph_name(kind, layer, last),
        kind,
        layer if kind not in ("final", "draft", "draft_reduce") else None,
        tuple(inputs),
        tuple(outputs),
        last if kind == "segment" else None,
    )


def segment_ranges(num_layers: int, cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """The layer ranges an export's segments cover: 1..L cut after each layer of `cuts` (its exit layers, its draft
    head's feature layers), those of two layers or more (a range of one layer is its layer graph)."""
    bounds = [0, *sorted({e for e in cuts if 1 <= e < num_layers}), num_layers]
    return [(a + 1, b) for a, b in itertools.pairwise(bounds) if b > a + 1]


def export_plan(
    spec: ModelSpec,
    exit_layers: tuple[int, ...],
    *,
    dtype: str,
    max_seq_len: int,
    max_batch: int = 1,
    with_logits: bool = False,
    exit_heads: bool = True,
    head_vocab: int | None = None,
    fused_exits: bool = False,
    segments: bool = False,
    draft: bool = False,
    feature_layers: tuple[int, ...] = (),
) -> list[SubgraphIO]:
    """Every subgraph of an export, in execution order: embed, layers (with exits after theirs), final, then
    (`segments`) the segments between the exit layers and the `feature_layers`, then (`draft`) the draft head, and
    its map of the feature layers' outputs and the last one's to one where it reads them (`feature_layers`).

    `exit_heads`: whether the exit layers have exit head graphs of their own (trained heads). Without
    them an exit layer's head is the model's own final norm and unembedding, which is the `final`
    graph itself, so no copy is written: the runtime runs `final` on the intermediate hidden state.
    `fused_exits` adds `layer_exit_e` (layer e and its exit head in one graph) for trained heads.
    """
    common = dict(dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch, with_logits=with_logits)
    plan = [subgraph_io(spec, "embed", **common)]
    for layer in range(1, spec.num_layers + 1):
        plan.append(subgraph_io(spec, "layer", layer, **common))
        if layer in exit_layers and exit_heads:
            plan.append(subgraph_io(spec, "exit", layer, **common, head_vocab=head_vocab))
            if fused_exits:
                plan.append(subgraph_io(spec, "layer_exit", layer, **common))
    plan.append(subgraph_io(spec, "final", **common))
    if segments:
        plan += [
            subgraph_io(spec, "segment", a, **common, last=b)
            for a, b in segment_ranges(spec.num_layers, (*exit_layers, *feature_layers))
        ]
    if draft:
        plan.append(subgraph_io(spec, "draft", **common))
        if feature_layers:
            plan.append(subgraph_io(spec, "draft_reduce", **common))
    return plan
