"""Functional pieces of the subgraphs: norms, rotary embeddings, the in-place cache write, attention.

Each follows the Hugging Face implementation's numerics (RMSNorm in float32, softmax in float32,
cos/sin computed in float32 and cast to the activation dtype) so the exported graphs reproduce the
original model's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The contract's dtype names (manifest dtype, TensorSpec.dtype) as torch dtypes.
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def onnx_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` as one ONNX RMSNormalization (opset 23) node: for fused graphs, under `torch.onnx.export` only."""
    return torch.onnx.ops.symbolic(
        "RMSNormalization",
        (x, weight),
        {"axis": -1, "epsilon": float(eps), "stash_type": 1},
        dtype=x.dtype,
        shape=x.shape,
        version=23,
    )


def rope_caches(inv_freq: torch.Tensor, scaling: float, length: int, dtype: torch.dtype) -> tuple:
    """cos and sin [length, rotary_dim / 2] for every position up to `length`, as `rope_cos_sin` computes them
    (half of each row: the other half repeats it): the tables an exported layer's rotary embeddings read."""
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq.to(torch.float32)[None]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


ATTENTION_DOMAIN = "paradecode"  # the placeholder's domain: expanded into standard operators at export
ATTENTION_OP = "CacheAttention"
ONNX_ELEMENT_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}  # onnx.TensorProto's codes


def exported_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    positions: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    num_heads: int,
    head_dim: int,
    scale: float,
    window: int | None,
    rotary_dim: int,
    rotary_op: bool,
    rotary_table: str = "rope",
):
    """The attention of a layer graph, under `torch.onnx.export`: one placeholder node, `paradecode::CacheAttention`,
    which export/attention.py expands into standard operators (docs/design.md §4):

    q [B, T, H*D_h], k and v [B, T, H_kv*D_h] before rotary embeddings; `tables` the rotary cos and sin tables
    [positions, rotary_dim / 2] (`rope_caches`; None: no rotary); caches [B, H_kv, S, D_h]. The keys and values of
    positions[b, 0] .. are written into the cache passed in (the runtime binds `present_*` to it) and every query
    attends over the whole cache it is given, a slot visible where it is at or before the query's position (and
    within `window`): what `attention` computes with `write_cache`, each graph checked against it at export.
    `rotary_op`: rotary embeddings as onnxruntime's RotaryEmbedding operator, else as elementwise operators;
    `rotary_table` names the tables (a model's layers may turn by two: Gemma 3's local and global bases), so layers
    composed into one segment share the rows of a table for the call's positions, and only of the same table.
    """
    cos, sin = tables if tables is not None else (None, None)
    attrs = {
        "num_heads": num_heads,
        "kv_num_heads": past_key.shape[1],
        "head_dim": head_dim,
        "scale": float(scale),
        "window": int(window or 0),
        "rotary_dim": int(rotary_dim if tables is not None else 0),
        "rotary_op": int(rotary_op),
        "rotary_table": rotary_table,
        "dtype": ONNX_ELEMENT_TYPES[q.dtype],
    }
    return torch.onnx.ops.symbolic_multi_out(
        f"{ATTENTION_DOMAIN}::{ATTENTION_OP}",
        (q, k, v, past_key, past_value, positions, cos, sin),
        attrs,
        dtypes=(q.dtype, past_key.dtype, past_value.dtype),
        shapes=(q.shape, past_key.shape, past_value.shape),
        version=1,
    )


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unknown activation {name!r}")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos and sin [B, 1, T, R] for integer positions [B, T]: R = 2 * len(inv_freq), the rotary dims."""
    freqs = positions[..., None].to(torch.float32) * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(dtype)
    sin = (emb.sin() * scaling).to(dtype)
    return cos[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D_h] turned by the rotary embedding in its first R dims (cos and sin [..., R]; R = D_h but for partial
    rotary embeddings, whose other dims pass through: Hugging Face's Phi-3 `apply_rotary_pos_emb`)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, passed = x[..., :rotary], x[..., rotary:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, passed), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in the order Hugging Face's Gemma computes it."""
    return torch.tanh(logits / cap) * cap


def write_cache(cache: torch.Tensor, update: torch.Tensor, write_index: torch.Tensor) -> torch.Tensor:
    """Write `update` [B, H, T, D] into `cache` [B, H, S, D] at slots write_index[b] .. + T - 1.

    In eager PyTorch the cache is updated in place and returned. Under `torch.onnx.export` this
    becomes the ONNX ``TensorScatter`` operator (opset 24), whose output the runtime binds to the
    input buffer so the update happens in place there too.
    """
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            "TensorScatter",
            (cache, update, write_index),
            {"axis": 2, "mode": "linear"},
            dtype=cache.dtype,
            shape=cache.shape,
            version=24,
        )
    batch, heads, tokens, dim = update.shape
    slots = write_index[:, None] + torch.arange(tokens, device=update.device)
    if batch == 1:  # one index vector: no host sync, so CUDA graphs can capture it
        return cache.index_copy_(2, slots[0], update)
    cache.scatter_(2, slots[:, None, :, None].expand(batch, heads, tokens, dim), update)
    return cache


def attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Grouped-query attention of q [B, H, T, D] over the whole fixed-size cache [B, H_kv, S, D].

    Query heads are grouped by the key/value head they share, so the cache is never expanded or
    copied. Slot s is visible to the query at position p iff s <= p (and p - s < window for a
    sliding window); slots past the current length are masked whatever they hold.

    Only the slots up to the highest position are read (in the exported graph a Slice whose end is
    computed from the positions), so a call costs what the sequence so far needs, not what the
    cache's fixed length would. On CUDA the eager path reads the whole cache instead: the slice's
    length would need a device-to-host copy, which CUDA graphs cannot capture; so does a module under
    torch.compile (a length read from the data is a shape Inductor cannot plan for), whose caches
    therefore start at 0 (runtime/kvcache.py).
    """
    if torch.onnx.is_in_onnx_export() or (key_cache.device.type == "cpu" and not torch.compiler.is_compiling()):
        span = positions.max() + 1
        key_cache, value_cache = key_cache[:, :, :span], value_cache[:, :, :span]
    batch, heads, tokens, dim = q.shape
    kv_heads, slots = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    q = q.reshape(batch, kv_heads, group * tokens, dim)
    scores = torch.matmul(q, key_cache.transpose(2, 3)) * scale
    scores = scores.view(batch, kv_heads, group, tokens, slots)
    slot = torch.arange(slots, device=positions.device)
    visible = slot[None, None, :] <= positions[:, :, None]
    if window is not None:
        visible = visible & (positions[:, :, None] - slot[None, None, :] < window)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores.to(torch.float32), dim=-1).to(q.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, group * tokens, slots), value_cache)
    return out.view(batch, heads, tokens, dim)
