"""A draft head's chains for every position of a batch at once: what training with its own guesses in the loop needs.

At decoding time (runtime/proposers.py `DraftProposer`) a chain starts at the newest verified position v: its first
guess reads the last layer's output at v - 1 beside tokens[v]'s embedding, each later guess the draft's own previous
output beside the previous guess's embedding, one call per guess over the draft's cache. `chain_outputs` computes the
same guesses for every start at once, one pass per depth, as EAGLE-3's training-time test does: a guess at depth k
is only ever made after k - 1 right ones, so the tokens it reads are the sequence's own.

Glossary (B sequences of T tokens, D hidden size, positions 0..T-1):

    h[p]       the last layer's output at position p: [B, T, D] (the final head reads it to choose tokens[p + 1])
    e[p]       tokens[p]'s embedding: [B, T, D]
    o_k[p]     the draft's depth-k output at position p, a guess at h[p]; its head reads it as a guess at
               tokens[p + 1]. o_1[p] reads h[p - 1] beside e[p]; o_k[p] (k > 1) reads o_{k-1}[p - 1] beside e[p]
    row        the draft layer's key and value at a position, in the draft's cache (the KV cache's layer L + 1)

What the depth-k query at position p sees, as the draft's cache holds it when that guess is made (the chain started
at v = p - k + 1):

    slot 0               zeros: the draft never writes position 0 (nothing comes before it)
    slots 1 .. v         depth-1 rows (fed from verified outputs)
    slot v + j - 1       the depth-j row, for j = 2 .. k (the chain's own)

and a sliding window, where the model's last layer has one, hides slots p - window and older, as in the cache.
Positions p < k start no chain of depth k: `chain_outputs` computes something there, which `depth_mask` leaves out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paradecode.graphs import ops
from paradecode.graphs.modules import DraftGraph, LayerGraph


def chain_outputs(draft: DraftGraph, hidden: torch.Tensor, embedded: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """o_1 .. o_depth at positions 1..T-1: `depth` tensors [B, T - 1, D], entry i holding position i + 1.

    `hidden` h[0..T-1] and `embedded` e[0..T-1], both [B, T, D]. Entries at positions p < k of depth k are not a
    chain's (see `depth_mask`)."""
    layer = draft.layer
    positions = torch.arange(1, hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
    cos_sin = None
    if layer.inv_freq is not None:
        cos_sin = ops.rope_cos_sin(positions, layer.inv_freq, layer.spec.rope_scaling, hidden.dtype)
    previous = hidden[:, :-1]  # the output each position's depth-1 guess reads: h[p - 1]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs = []
    for _ in range(depth):
        x = draft.fuse(torch.cat([previous, embedded[:, 1:]], dim=-1))
        q, key, value = layer.attn.project(layer.attn_norm(x), cos_sin)
        keys.append(key)
        values.append(value)
        attn = layer.attn.o(_chain_attention(layer, q, keys, values, positions))
        x = x + layer.post_norm(layer.post_attn_norm, attn)
        x = x + layer.post_norm(layer.post_mlp_norm, layer.mlp(layer.mlp_norm(x)))
        outputs.append(x)
        previous = F.pad(x[:, :-1], (0, 0, 1, 0))  # o_k[p - 1] for position p (position 1 has none: zeros)
    return outputs


def depth_mask(tokens: int, depth: int, device: torch.device | None = None) -> torch.Tensor:
    """[T - 1] bool: which of `chain_outputs`' entries (positions 1..T-1) a chain of depth `depth` reaches."""
    return torch.arange(1, tokens, device=device) >= depth


def _shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [B, H, T, d] moved `by` positions later along T (entry i holds x[i - by]; the first `by` entries zeros)."""
    return x if by == 0 else F.pad(x[:, :, : x.shape[2] - by], (0, 0, by, 0))


def _chain_attention(
    layer: LayerGraph, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor
) -> torch.Tensor:
    """The depth-k queries' attention (k = len(keys)) over what the cache holds for them (the module docstring):
    [B, T, H * d]."""
    spec, window = layer.spec, layer.attn.window
    k = len(keys)
    batch, heads, tokens, dim = q.shape
    group = heads // spec.num_kv_heads
    p = positions[0]  # [T]: the same positions in every row
    rows = [key.repeat_interleave(group, dim=1) for key in keys]
    cells = [value.repeat_interleave(group, dim=1) for value in values]
    # slot 0 (zeros: a logit of 0, a value of 0) and the depth-1 rows of slots 1 .. p - k + 1
    visible = p[None, :] <= p[:, None] - k + 1  # [T, T]: query at p, depth-1 row at slot p[j]
    sink = torch.ones_like(p, dtype=torch.bool)
    if window is not None:
        visible = visible & (p[:, None] - p[None, :] < window)
        sink = p < window
    scores = [torch.zeros(batch, heads, tokens, 1, dtype=q.dtype, device=q.device).masked_fill(~sink[:, None], -1e30)]
    scores.append(torch.matmul(q, rows[0].transpose(2, 3)).masked_fill(~visible, float("-inf")) * spec.scale)
    for j in range(2, k + 1):  # the depth-j row at slot p - (k - j) (zeros where p < k: no chain reaches there)
        scores.append((q * _shifted(rows[j - 1], k - j)).sum(-1, keepdim=True) * spec.scale)
    probs = torch.softmax(torch.cat(scores, dim=-1).to(torch.float32), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., 1 : tokens + 1], cells[0])
    for j in range(2, k + 1):
        out = out + probs[..., tokens + j - 1 : tokens + j] * _shifted(cells[j - 1], k - j)
    return out.transpose(1, 2).reshape(batch, tokens, heads * dim)
