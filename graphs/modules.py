"""The subgraph torch modules: what gets exported to ONNX and what the torch backend runs.

Weights use one canonical naming, independent of the source framework:

    embed.tokens.weight, embed.positions.weight          (learned positions only)
    layers.{i}.attn_norm.{weight,bias}                   (i = 1..L; bias for LayerNorm only)
    layers.{i}.attn.{q,k,v,o}.{weight,bias}              (Linear layout [out, in])
    layers.{i}.attn.{q_norm,k_norm}.weight               (q/k norm only)
    layers.{i}.post_attn_norm.weight                     (sandwich norms only: on the attention's output)
    layers.{i}.mlp_norm.{weight,bias}
    layers.{i}.mlp.{gate,up,down}.{weight,bias}          (gate for gated MLPs only)
    layers.{i}.post_mlp_norm.weight                      (sandwich norms only: on the MLP's output)
    rope.inv_freq                                        (rotary positions only; float32 [rotary_dims / 2])
    rope_local.inv_freq                                  (the layers `spec.local_rope` marks read it instead)
    norm.{weight,bias}                                   (final norm)
    unembed.weight                                       (absent when tied to embed.tokens)
    exits.{e}.transform                                  (trained exit-head matrix [D, D])
    exits.vocab, exits.unembed                           (the exit heads' reduced vocabulary: token ids
                                                          [N] int64 and their unembedding rows [N, D])
    draft.fuse.weight                                    (the draft head's fusion [D, 2D]: export/draft_head.py)
    draft.layer.*                                        (its decoder layer: a layer's names, as layers.{i}.*)
    draft.vocab, draft.unembed                           (its reduced vocabulary: token ids [N] and their rows)
    draft.reduce.weight                                  (a head reading three layers: their map to one [D, 3D])

A module's parameters are the very tensors of the weights it was built from wherever the dtype
allows (`build_subgraph`), so modules that read the same weight (a tied embedding and unembedding,
a layer and its fused layer+exit graph) hold it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paradecode.graphs import ops
from paradecode.graphs.errors import ManifestError
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import SubgraphIO


class Norm(nn.Module):
    def __init__(self, kind: str, dim: int, eps: float):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layer" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return ops.rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.spec, self.window = spec, spec.window(layer)
        self.table = spec.rope_table(layer) if spec.positions == "rope" else ""
        heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q = nn.Linear(spec.hidden_size, heads * dim, bias=spec.qkv_bias)
        self.k = nn.Linear(spec.hidden_size, kv_heads * dim, bias=spec.qkv_bias)
        self.v = nn.Linear(spec.hidden_size, kv_heads * dim, bias=spec.qkv_bias)
        self.o = nn.Linear(heads * dim, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = Norm("rms", dim, spec.norm_eps)
            self.k_norm = Norm("rms", dim, spec.norm_eps)

    def exported(self, x, positions, past_key, past_value, tables, *, fused: bool):
        """This attention as an exported graph computes it (`ops.exported_attention`), under ONNX export only:
        `fused`, with onnxruntime's RMSNormalization and RotaryEmbedding operators, else elementwise ones."""
        spec = self.spec
        batch, tokens, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if spec.qk_norm:
            q = q.view(batch, tokens, spec.num_heads, spec.head_dim)
            k = k.view(batch, tokens, spec.num_kv_heads, spec.head_dim)
            if fused:
                q = ops.onnx_rms_norm(q, self.q_norm.weight, spec.norm_eps)
                k = ops.onnx_rms_norm(k, self.k_norm.weight, spec.norm_eps)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.reshape(batch, tokens, spec.num_heads * spec.head_dim)
            k = k.reshape(batch, tokens, spec.num_kv_heads * spec.head_dim)
        out, present_key, present_value = ops.exported_attention(
            q,
            k,
            v,
            past_key,
            past_value,
            positions,
            tables,
            num_heads=spec.num_heads,
            head_dim=spec.head_dim,
            scale=spec.scale,
            window=self.window,
            rotary_dim=spec.rotary_dims,
            rotary_op=fused,
            rotary_table=self.table,
        )
        return self.o(out), present_key, present_value

    def project(self, x, cos_sin):
        """q [B, H, T, d], k and v [B, H_kv, T, d] of x [B, T, D]; q and k turned by `cos_sin` (rotary positions)."""
        spec = self.spec
        batch, tokens, _ = x.shape
        q = self.q(x).view(batch, tokens, spec.num_heads, spec.head_dim)
        k = self.k(x).view(batch, tokens, spec.num_kv_heads, spec.head_dim)
        v = self.v(x).view(batch, tokens, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cos_sin is not None:
            q, k = ops.apply_rope(q, *cos_sin), ops.apply_rope(k, *cos_sin)
        return q, k, v

    def forward(self, x, positions, past_key, past_value, inv_freq):
        spec = self.spec
        batch, tokens, _ = x.shape
        cos_sin = None if inv_freq is None else ops.rope_cos_sin(positions, inv_freq, spec.rope_scaling, x.dtype)
        q, k, v = self.project(x, cos_sin)
        write_index = positions[:, 0]
        present_key = ops.write_cache(past_key, k, write_index)
        present_value = ops.write_cache(past_value, v, write_index)
        out = ops.attention(q, present_key, present_value, positions, scale=spec.scale, window=self.window)
        out = out.transpose(1, 2).reshape(batch, tokens, spec.num_heads * spec.head_dim)
        return self.o(out), present_key, present_value


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind, self.act = spec.mlp, spec.activation
        if spec.mlp == "gated":
            self.gate = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.up = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gated":
            return self.down(ops.activation(self.act, self.gate(x)) * self.up(x))
        return self.down(ops.activation(self.act, self.up(x)))


class EmbedGraph(nn.Module):
    """input_ids [B, T] (+ positions [B, T] for learned positions) -> hidden [B, T, D]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        if spec.positions == "learned":
            self.positions = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
        if spec.embed_scale is not None:  # a float32 scalar, not a weight: cast to the activations' dtype as Gemma does
            self.register_buffer("scale", torch.tensor(spec.embed_scale, dtype=torch.float32), persistent=False)
        else:
            self.scale = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.tokens(input_ids)
        if self.scale is not None:
            hidden = hidden * self.scale.to(hidden.dtype)
        if hasattr(self, "positions"):
            hidden = hidden + self.positions(positions)
        return hidden


class LayerGraph(nn.Module):
    """One pre-norm decoder layer with its KV cache written in place.

    Eager PyTorch runs the reference below. A module built for export (`ops`: "fused" or "portable") exports its
    attention as one placeholder that export/attention.py expands into standard operators over the whole cache it
    is given (`ops.exported_attention`), its rotary embeddings reading the tables `cos_cache` / `sin_cache`
    (canonical `rope.cos` / `rope.sin`, `max_seq_len` positions); "fused" makes its RMS norms and rotary embeddings
    onnxruntime's RMSNormalization and RotaryEmbedding operators, "portable" elementwise operators, which TensorRT
    reads too. Each exported graph is validated against the eager module.
    """

    def __init__(self, spec: ModelSpec, layer: int, *, ops: str | None = None, max_seq_len: int | None = None):
        super().__init__()
        self.spec, self.fused = spec, ops == "fused"
        self.attn_norm = Norm(spec.norm, spec.hidden_size, spec.norm_eps)
        self.attn = Attention(spec, layer)
        self.mlp_norm = Norm(spec.norm, spec.hidden_size, spec.norm_eps)
        self.mlp = MLP(spec)
        self.post_attn_norm = self.post_mlp_norm = None
        if spec.sandwich_norms:
            self.post_attn_norm = Norm(spec.norm, spec.hidden_size, spec.norm_eps)
            self.post_mlp_norm = Norm(spec.norm, spec.hidden_size, spec.norm_eps)
        if spec.positions == "rope":
            self.register_buffer("inv_freq", torch.zeros(spec.rotary_dims // 2))
        else:
            self.inv_freq = None
        self.tables = ops is not None and spec.positions == "rope"  # the exported graph's rotary tables
        if self.tables:
            if max_seq_len is None:
                raise ValueError("a layer module for export needs max_seq_len (the length of its rotary tables)")
            self.register_buffer("cos_cache", torch.zeros(max_seq_len, spec.rotary_dims // 2))
            self.register_buffer("sin_cache", torch.zeros(max_seq_len, spec.rotary_dims // 2))

    def norm(self, norm: Norm, x: torch.Tensor) -> torch.Tensor:
        if self.fused and norm.kind == "rms" and torch.onnx.is_in_onnx_export():
            return ops.onnx_rms_norm(x, norm.weight, norm.eps)
        return norm(x)

    def post_norm(self, norm: Norm | None, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output through its sandwich norm, where the model has them."""
        return x if norm is None else self.norm(norm, x)

    def forward(self, hidden, positions, past_key, past_value):
        if torch.onnx.is_in_onnx_export():
            tables = None  # float32 tables, cast to the activations' dtype
            if self.inv_freq is not None:
                if not self.tables:
                    raise ValueError("a layer module built without `ops` cannot be exported (no rotary tables)")
                tables = (self.cos_cache.to(hidden.dtype), self.sin_cache.to(hidden.dtype))
            attn, present_key, present_value = self.attn.exported(
                self.norm(self.attn_norm, hidden), positions, past_key, past_value, tables, fused=self.fused
            )
        else:
            attn, present_key, present_value = self.attn(
                self.attn_norm(hidden), positions, past_key, past_value, self.inv_freq
            )
        hidden = hidden + self.post_norm(self.post_attn_norm, attn)
        hidden = hidden + self.post_norm(self.post_mlp_norm, self.mlp(self.norm(self.mlp_norm, hidden)))
        return hidden, present_key, present_value


class HeadGraph(nn.Module):
    """hidden [B, T, D] -> top-1 token, its probability, the top-1/top-2 logit margin (+ logits).

    An exit head may carry a trained transform T (logits = E · norm(T · h)); without one it is the
    model's own final norm and unembedding applied to an intermediate hidden state. With a reduced
    vocabulary of N token ids (`vocab`), E holds only their rows: the head's distribution is over
    those N tokens (zero elsewhere), and its `token` is mapped back to a model token id.
    """

    def __init__(
        self, spec: ModelSpec, *, transform: bool = False, vocab: int | None = None, with_logits: bool = False
    ):
        super().__init__()
        self.with_logits, self.softcap = with_logits, spec.final_logit_softcap
        self.transform = nn.Linear(spec.hidden_size, spec.hidden_size, bias=False) if transform else None
        self.norm = Norm(spec.norm, spec.hidden_size, spec.norm_eps)
        self.unembed = nn.Linear(spec.hidden_size, vocab or spec.vocab_size, bias=False)
        if vocab:
            self.register_buffer("vocab", torch.zeros(vocab, dtype=torch.int64))
        else:
            self.vocab = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            hidden = self.transform(hidden)
        logits = self.unembed(self.norm(hidden))
        return logits if self.softcap is None else ops.softcap(logits, self.softcap)

    def forward(self, hidden: torch.Tensor):
        logits = self.logits(hidden)
        scores = logits.to(torch.float32)
        token = torch.argmax(scores, dim=-1)
        if self.vocab is not None:
            token = self.vocab[token]
        top2 = torch.topk(scores, 2, dim=-1).values
        prob = torch.exp(top2[..., 0] - torch.logsumexp(scores, dim=-1))
        margin = top2[..., 0] - top2[..., 1]
        if self.with_logits:
            return token, prob, margin, logits
        return token, prob, margin


class LayerExitGraph(nn.Module):
    """Layer e and exit head e in one graph: the layer's outputs plus the head's on the last position."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        *,
        transform: bool,
        vocab: int | None = None,
        ops: str | None = None,
        max_seq_len: int | None = None,
    ):
        super().__init__()
        self.layer = LayerGraph(spec, layer, ops=ops, max_seq_len=max_seq_len)
        self.head = HeadGraph(spec, transform=transform, vocab=vocab)

    def forward(self, hidden, positions, past_key, past_value):
        hidden, present_key, present_value = self.layer(hidden, positions, past_key, past_value)
        token, prob, margin = self.head(hidden[:, -1:])
        return hidden, present_key, present_value, token, prob, margin


class DraftGraph(nn.Module):
    """A draft head (export/draft_head.py): for each position p, the last layer's output at p - 1 and the embedding of
    tokens[p], concatenated and fused by one linear map, through one decoder layer of its own (shaped as the model's
    last layer, with a cache of its own), give a guess at the last layer's output at p; the model's final norm and the
    unembedding rows of a reduced vocabulary read it as a guess at tokens[p + 1] (top-1, as a head's outputs).

    forward(hidden, embedded, positions, past_key, past_value) -> (hidden_out, present_key, present_value, token,
    prob, margin): drafting a chain feeds each call's `hidden_out` back as the next call's `hidden`.
    """

    def __init__(self, spec: ModelSpec, *, vocab: int, ops: str | None = None, max_seq_len: int | None = None):
        super().__init__()
        self.fuse = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=False)
        self.layer = LayerGraph(spec, spec.num_layers, ops=ops, max_seq_len=max_seq_len)
        self.head = HeadGraph(spec, vocab=vocab)

    def forward(self, hidden, embedded, positions, past_key, past_value):
        fused = self.fuse(torch.cat([hidden, embedded], dim=-1))
        hidden, present_key, present_value = self.layer(fused, positions, past_key, past_value)
        token, prob, margin = self.head(hidden)
        return hidden, present_key, present_value, token, prob, margin


class DraftReduceGraph(nn.Module):
    """A draft head's map of three layers' outputs at a position (a low, a middle and the last layer's, side by side:
    [B, T, 3D]) to the one [B, T, D] its `DraftGraph` call over that position reads (EAGLE-3's fusion)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.reduce = nn.Linear(3 * spec.hidden_size, spec.hidden_size, bias=False)

    def forward(self, features):
        return self.reduce(features)


class SegmentGraph(nn.Module):
    """Layers first..last in one call: each layer's inputs and outputs as `LayerGraph`'s, chained.

    forward(hidden, positions, past_key_first, past_value_first, ..., past_key_last, past_value_last)
    -> (hidden_out, present_key_first, present_value_first, ...), every cache written in place. Exported
    segments are composed from the layers' own graphs (export/segments.py); this module is their reference
    and what the torch backend runs.
    """

    def __init__(self, spec: ModelSpec, first: int, last: int):
        super().__init__()
        self.first = first
        self.layers = nn.ModuleList(LayerGraph(spec, i) for i in range(first, last + 1))

    def forward(self, hidden, positions, *caches):
        presents = []
        for i, layer in enumerate(self.layers):
            hidden, key, value = layer(hidden, positions, caches[2 * i], caches[2 * i + 1])
            presents += [key, value]
        return (hidden, *presents)


def subgraph_state(
    spec: ModelSpec, io: SubgraphIO, weights: dict[str, torch.Tensor], *, ops: str | None = None
) -> dict[str, torch.Tensor]:
    """The module-local state dict of one subgraph, taken from the canonical weights (`ops`: of the module built
    for export with those operators, which also reads the rotary tables)."""
    if io.kind == "layer_exit":
        layer = SubgraphIO(f"layer_{io.layer}", "layer", io.layer, io.inputs, io.outputs[:3])
        head = SubgraphIO(f"exit_{io.layer}", "exit", io.layer, io.inputs[:1], io.outputs[3:])
        return {
            **{f"layer.{k}": v for k, v in subgraph_state(spec, layer, weights, ops=ops).items()},
            **{f"head.{k}": v for k, v in subgraph_state(spec, head, weights).items()},
        }
    if io.kind == "embed":
        prefix = "embed."
        return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if io.kind == "draft":
        layer = {k[len("draft.layer.") :]: v for k, v in weights.items() if k.startswith("draft.layer.")}
        layer.update(rope_state(spec, spec.num_layers, weights, ops=ops))
        final = SubgraphIO("final", "final", None, (), ())
        head = {**subgraph_state(spec, final, weights), "unembed.weight": weights["draft.unembed"]}
        return {
            "fuse.weight": weights["draft.fuse.weight"],
            **{f"layer.{k}": v for k, v in layer.items()},
            **{f"head.{k}": v for k, v in head.items()},
            "head.vocab": weights["draft.vocab"],
        }
    if io.kind == "draft_reduce":
        return {"reduce.weight": weights["draft.reduce.weight"]}
    if io.kind == "segment":
        state = {}
        for index, layer in enumerate(range(io.layer, io.last + 1)):
            one = SubgraphIO(f"layer_{layer}", "layer", layer, (), ())
            state.update({f"layers.{index}.{k}": v for k, v in subgraph_state(spec, one, weights).items()})
        return state
    if io.kind == "layer":
        prefix = f"layers.{io.layer}."
        state = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        return {**state, **rope_state(spec, io.layer, weights, ops=ops)}
    state = {k: v for k, v in weights.items() if k.startswith(("norm.", "unembed."))}
    if "unembed.weight" not in state and spec.tie_word_embeddings:
        state["unembed.weight"] = weights["embed.tokens.weight"]
    if io.kind == "exit" and f"exits.{io.layer}.transform" in weights:
        state["transform.weight"] = weights[f"exits.{io.layer}.transform"]
    if io.kind == "exit" and "exits.vocab" in weights:
        state["unembed.weight"], state["vocab"] = weights["exits.unembed"], weights["exits.vocab"]
    return state


def rope_state(spec: ModelSpec, layer: int, weights: dict[str, torch.Tensor], *, ops: str | None) -> dict:
    """The rotary buffers of layer `layer`'s module (with `ops`, the exported graph's tables too); none without
    rotary positions."""
    if spec.positions != "rope":
        return {}
    table = spec.rope_table(layer)
    state = {"inv_freq": weights[f"{table}.inv_freq"]}
    if ops is not None:
        state["cos_cache"], state["sin_cache"] = weights[f"{table}.cos"], weights[f"{table}.sin"]
    return state


def head_vocab(weights: dict[str, torch.Tensor]) -> int | None:
    """The size of the exit heads' reduced vocabulary, None for the whole vocabulary."""
    return len(weights["exits.vocab"]) if "exits.vocab" in weights else None


def load_exact(module: nn.Module, state: dict[str, torch.Tensor], what: str, dtype: torch.dtype) -> None:
    """Put `state`'s tensors into `module`, asserting every key and shape; name what is missing or extra.

    Parameters become `state`'s tensors themselves, converted to `dtype` (no copy where they already
    are); buffers (rotary frequencies, vocabulary ids) keep their dtype. Nothing is copied that need not be.
    """
    expected = module.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [
        f"{k}: got {tuple(state[k].shape)}, expected {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(state))
        if state[k].shape != expected[k].shape
    ]
    if missing or unexpected or wrong:
        raise ManifestError(
            f"weights for {what} do not fit its module: missing {missing}, unexpected {unexpected}, "
            f"wrong shapes {wrong}."
        )
    parameters = dict(module.named_parameters())
    for key in expected:
        owner, _, leaf = key.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        if key in parameters:
            holder._parameters[leaf] = nn.Parameter(state[key].detach().to(dtype), requires_grad=False)
        else:
            holder._buffers[leaf] = state[key].detach()


def build_subgraph(
    spec: ModelSpec,
    io: SubgraphIO,
    weights: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    with_logits: bool = False,
    ops: str | None = None,
    max_seq_len: int | None = None,
) -> nn.Module:
    """Build the torch module of one subgraph, loaded from canonical weights, in `dtype`; `ops` ("fused" or
    "portable"): the module to export with those operators, whose rotary tables hold `max_seq_len` positions.

    Parameters take `dtype`; buffers (the rotary inverse frequencies) stay float32.
    """
    if io.kind == "embed":
        module = EmbedGraph(spec)
    elif io.kind == "layer":
        module = LayerGraph(spec, io.layer, ops=ops, max_seq_len=max_seq_len)
    elif io.kind == "segment":
        module = SegmentGraph(spec, io.layer, io.last)
    elif io.kind == "layer_exit":
        transform = f"exits.{io.layer}.transform" in weights
        module = LayerExitGraph(
            spec, io.layer, transform=transform, vocab=head_vocab(weights), ops=ops, max_seq_len=max_seq_len
        )
    elif io.kind == "draft":
        module = DraftGraph(spec, vocab=len(weights["draft.vocab"]), ops=ops, max_seq_len=max_seq_len)
    elif io.kind == "draft_reduce":
        module = DraftReduceGraph(spec)
    elif io.kind == "exit":
        transform = f"exits.{io.layer}.transform" in weights
        module = HeadGraph(spec, transform=transform, vocab=head_vocab(weights), with_logits=with_logits)
    else:
        module = HeadGraph(spec, with_logits=with_logits)
    load_exact(module, subgraph_state(spec, io, weights, ops=ops), io.name, dtype)
    return module.eval()
