"""Where each family's tensors go in a GGUF file, and the Hugging Face names transformers maps them to.

One layout per registered family, as llama.cpp's `convert_hf_to_gguf.py` writes that architecture:
llama.cpp's tensor names (`token_embd.weight`, `blk.{i}.attn_q.weight`, ...), shapes [rows, row length]
in numpy order (a Linear weight's [out, in]), and the few layout changes transformers undoes on load:
- llama and mistral: the rows of Q and K permuted per head (`LlamaModel.permute`);
- gpt2: Conv1D weights ([in, out]) transposed to [out, in], q/k/v fused in `attn_qkv`;
- qwen2 and qwen3: Hugging Face's layout as is;
- gemma3: every norm weight stored plus one (llama.cpp's `norm_shift`; transformers subtracts it), Gemma's four
  norms a layer under their own names (`post_attention_norm`, `ffn_norm` before the MLP, `post_ffw_norm`);
- phi3: q/k/v in one matrix (`attn_qkv`) and gate/up in one (`ffn_up`), as Phi-3's checkpoints hold them.
Mistral checkpoints are written with architecture "llama" (llama.cpp has no "mistral" architecture),
so transformers reads them as a llama model.

transformers reads some sizes from no key at all, and the layouts refuse shapes it would misread: see
each `check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

LAYOUTS: dict[str, Layout] = {}


@dataclass(frozen=True)
class TinyShape:
    """A tiny model's sizes. `key_length` is the head size where it is not hidden // heads."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 96
    layers: int = 4
    context: int = 128
    key_length: int | None = None
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its GGUF name and shape, and the Hugging Face parameter it becomes.

    `layout` says how the GGUF layout differs from Hugging Face's: "as-is", "permuted" (rows reordered
    per head for llama.cpp's rotary embedding, `heads` of them), "transposed" (GPT-2's Conv1D) or "shifted"
    (Gemma's norm weights, stored plus one).
    `role` says how it is stored: "matrix" in the chosen block type; "norm", "bias" and "positions" F32.
    """

    name: str
    hf_name: str
    shape: tuple[int, ...]
    role: str = "matrix"
    layout: str = "as-is"
    heads: int = 0

    @property
    def kind(self) -> str:
        """The name without layer and suffix: "attn_q" for blk.3.attn_q.weight, "token_embd" for token_embd.weight."""
        return self.name.split(".")[-2]

    @property
    def base_name(self) -> str:
        """The name without its suffix: "blk.3.attn_q" for blk.3.attn_q.weight."""
        return self.name.rsplit(".", 1)[0]

    def to_hf(self, values: np.ndarray) -> np.ndarray:
        """Values in the file's layout -> the Hugging Face parameter transformers makes of them."""
        if self.layout == "permuted":
            return unpermute_from_gguf(values, self.heads)
        if self.layout == "transposed":
            return np.ascontiguousarray(values.T)
        if self.layout == "shifted":  # transformers' Gemma2TensorProcessor: `weights - 1`
            return values - 1
        return values

    def to_gguf(self, values: np.ndarray) -> np.ndarray:
        """A Hugging Face parameter -> the layout the file holds it in (the inverse of `to_hf`)."""
        if self.layout == "permuted":
            return permute_for_gguf(values, self.heads)
        if self.layout == "transposed":
            return np.ascontiguousarray(values.T)
        if self.layout == "shifted":
            return values + 1
        return values


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of Q/K rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute_for_gguf` (what transformers' LlamaTensorProcessor does on load)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def register(cls: type[Layout]) -> type[Layout]:
    LAYOUTS[cls.family] = cls()
    return cls


def layout_for(family: str) -> Layout:
    try:
        return LAYOUTS[family]
    except KeyError:
        raise ValueError(f"no tiny GGUF layout for family {family!r}; known: {sorted(LAYOUTS)}.") from None


class Layout:
    family: ClassVar[str]
    arch: ClassVar[str]  # general.architecture
    model_type: ClassVar[str]  # what transformers builds from the file
    small: ClassVar[TinyShape]  # the default shape (rows of multiples of 32)
    k_quant: ClassVar[TinyShape]  # the default shape for K-quants (rows of multiples of 256)

    def tensors(self, shape: TinyShape, vocab: int, tied: bool) -> list[TensorSpec]:
        raise NotImplementedError

    def write_metadata(self, writer, shape: TinyShape, vocab: int) -> None:
        raise NotImplementedError

    def check(self, shape: TinyShape, with_tokenizer: bool) -> None:
        """Refuse a shape transformers would read back as another (a ValueError saying why)."""
        if shape.heads % shape.kv_heads:
            raise ValueError(f"{shape.heads} query heads cannot share {shape.kv_heads} key/value heads evenly.")
        if shape.hidden % shape.heads:
            raise ValueError(
                f"hidden size {shape.hidden} is not a multiple of {shape.heads} heads: transformers' configs refuse "
                "that even where the head size is given."
            )


@register
class Llama(Layout):
    family = arch = model_type = "llama"
    small = TinyShape()
    k_quant = TinyShape(hidden=256, intermediate=256, layers=2)
    permuted: ClassVar[bool] = True  # Q/K rows permuted (convert_hf_to_gguf's LlamaModel)
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False
    writes_key_length: ClassVar[bool] = True  # the Hugging Face config has head_dim
    writes_rope_dimension: ClassVar[bool] = True  # convert_hf_to_gguf's LlamaModel writes it

    def tensors(self, shape: TinyShape, vocab: int, tied: bool) -> list[TensorSpec]:
        d, hd, f, h, kv = shape.hidden, shape.head_dim, shape.intermediate, shape.heads, shape.kv_heads
        rotary = "permuted" if self.permuted else "as-is"
        specs = [
            TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
            TensorSpec("output_norm.weight", "model.norm.weight", (d,), "norm"),
        ]
        if not tied:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i in range(shape.layers):
            b, p = f"blk.{i}.", f"model.layers.{i}."
            specs += [
                TensorSpec(b + "attn_norm.weight", p + "input_layernorm.weight", (d,), "norm"),
                TensorSpec(b + "attn_q.weight", p + "self_attn.q_proj.weight", (h * hd, d), layout=rotary, heads=h),
                TensorSpec(b + "attn_k.weight", p + "self_attn.k_proj.weight", (kv * hd, d), layout=rotary, heads=kv),
                TensorSpec(b + "attn_v.weight", p + "self_attn.v_proj.weight", (kv * hd, d)),
                TensorSpec(b + "attn_output.weight", p + "self_attn.o_proj.weight", (d, h * hd)),
                TensorSpec(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (d,), "norm"),
                TensorSpec(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (f, d)),
                TensorSpec(b + "ffn_up.weight", p + "mlp.up_proj.weight", (f, d)),
                TensorSpec(b + "ffn_down.weight", p + "mlp.down_proj.weight", (d, f)),
            ]
            if self.qkv_bias:
                specs += [
                    TensorSpec(b + f"attn_{x}.bias", p + f"self_attn.{x}_proj.bias", (n * hd,), "bias")
                    for x, n in (("q", h), ("k", kv), ("v", kv))
                ]
            if self.qk_norm:
                specs += [
                    TensorSpec(b + f"attn_{x}_norm.weight", p + f"self_attn.{x}_norm.weight", (hd,), "norm")
                    for x in "qk"
                ]
        return specs

    def write_metadata(self, writer, shape: TinyShape, vocab: int) -> None:
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.eps)
        writer.add_vocab_size(vocab)
        if self.writes_rope_dimension:
            writer.add_rope_dimension_count(shape.head_dim)
        if self.writes_key_length:
            writer.add_key_length(shape.head_dim)
            writer.add_value_length(shape.head_dim)


@register
class Mistral(Llama):
    """Written as "llama", as llama.cpp's converter writes MistralForCausalLM (no sliding-window key)."""

    family = "mistral"
    small = TinyShape(hidden=64, heads=8, kv_heads=2, key_length=16, intermediate=64, layers=3)
    k_quant = TinyShape(hidden=256, heads=8, kv_heads=2, key_length=64, intermediate=512, layers=2)


@register
class Qwen2(Llama):
    family = arch = model_type = "qwen2"
    small = TinyShape(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=3)
    permuted = False
    qkv_bias = True
    writes_key_length = writes_rope_dimension = False

    def check(self, shape: TinyShape, with_tokenizer: bool) -> None:
        super().check(shape, with_tokenizer)
        if shape.head_dim != shape.hidden // shape.heads:
            raise ValueError(
                f"a qwen2 GGUF file cannot carry a head size ({shape.head_dim}) other than hidden // heads "
                f"({shape.hidden // shape.heads}): transformers' qwen2 GGUF mapping reads none and Qwen2Config "
                "derives it."
            )


@register
class Qwen3(Llama):
    family = arch = model_type = "qwen3"
    small = TinyShape(hidden=64, heads=4, kv_heads=2, key_length=128, intermediate=96, layers=3)
    k_quant = TinyShape(hidden=256, heads=4, kv_heads=2, key_length=128, intermediate=256, layers=2)
    permuted = False
    qk_norm = True
    writes_rope_dimension = False

    def check(self, shape: TinyShape, with_tokenizer: bool) -> None:
        super().check(shape, with_tokenizer)
        if shape.head_dim != 128:
            raise ValueError(
                f"a qwen3 GGUF file with head size {shape.head_dim} would be read with head size 128: transformers' "
                "qwen3 GGUF mapping ignores attention.key_length and Qwen3Config's head_dim defaults to 128. "
                "Use key_length=128."
            )


@register
class Gemma3(Layout):
    """transformers reads gemma3 files as `gemma3_text` with `layer_types` of its default pattern (every sixth layer
    full, the rest sliding: `small` has six layers, so one of them is full) and the config's defaults where the file
    says nothing (query_pre_attn_scalar 256, the sliding layers' rotary base 10,000, no logit cap)."""

    family = arch = "gemma3"
    model_type = "gemma3_text"
    small = TinyShape(hidden=64, heads=4, kv_heads=1, key_length=16, intermediate=96, layers=6, eps=1e-6)
    k_quant = TinyShape(hidden=256, heads=16, kv_heads=1, key_length=16, intermediate=512, layers=2, eps=1e-6)
    window: ClassVar[int] = 5

    def tensors(self, shape: TinyShape, vocab: int, tied: bool) -> list[TensorSpec]:
        d, hd, f, h, kv = shape.hidden, shape.head_dim, shape.intermediate, shape.heads, shape.kv_heads
        specs = [
            TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
            TensorSpec("output_norm.weight", "model.norm.weight", (d,), "norm", "shifted"),
        ]
        if not tied:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i in range(shape.layers):
            b, p = f"blk.{i}.", f"model.layers.{i}."
            specs += [
                TensorSpec(b + "attn_norm.weight", p + "input_layernorm.weight", (d,), "norm", "shifted"),
                TensorSpec(b + "attn_q.weight", p + "self_attn.q_proj.weight", (h * hd, d)),
                TensorSpec(b + "attn_k.weight", p + "self_attn.k_proj.weight", (kv * hd, d)),
                TensorSpec(b + "attn_v.weight", p + "self_attn.v_proj.weight", (kv * hd, d)),
                TensorSpec(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", (hd,), "norm", "shifted"),
                TensorSpec(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", (hd,), "norm", "shifted"),
                TensorSpec(b + "attn_output.weight", p + "self_attn.o_proj.weight", (d, h * hd)),
                TensorSpec(
                    b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", (d,), "norm", "shifted"
                ),
                TensorSpec(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight", (d,), "norm", "shifted"),
                TensorSpec(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (f, d)),
                TensorSpec(b + "ffn_up.weight", p + "mlp.up_proj.weight", (f, d)),
                TensorSpec(b + "ffn_down.weight", p + "mlp.down_proj.weight", (d, f)),
                TensorSpec(
                    b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", (d,), "norm", "shifted"
                ),
            ]
        return specs

    def write_metadata(self, writer, shape: TinyShape, vocab: int) -> None:
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.eps)
        writer.add_sliding_window(self.window)
        writer.add_vocab_size(vocab)


@register
class Phi3(Layout):
    """transformers' phi3 GGUF mapping reads no partial rotary factor and no rope scaling: a file written for full
    rotary embeddings and the default rope."""

    family = arch = model_type = "phi3"
    small = TinyShape(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=3)
    k_quant = TinyShape(hidden=256, heads=4, kv_heads=2, intermediate=256, layers=2)

    def tensors(self, shape: TinyShape, vocab: int, tied: bool) -> list[TensorSpec]:
        d, hd, f, h, kv = shape.hidden, shape.head_dim, shape.intermediate, shape.heads, shape.kv_heads
        specs = [
            TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
            TensorSpec("output_norm.weight", "model.norm.weight", (d,), "norm"),
        ]
        if not tied:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i in range(shape.layers):
            b, p = f"blk.{i}.", f"model.layers.{i}."
            specs += [
                TensorSpec(b + "attn_norm.weight", p + "input_layernorm.weight", (d,), "norm"),
                TensorSpec(b + "attn_qkv.weight", p + "self_attn.qkv_proj.weight", ((h + 2 * kv) * hd, d)),
                TensorSpec(b + "attn_output.weight", p + "self_attn.o_proj.weight", (d, h * hd)),
                TensorSpec(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (d,), "norm"),
                TensorSpec(b + "ffn_up.weight", p + "mlp.gate_up_proj.weight", (2 * f, d)),
                TensorSpec(b + "ffn_down.weight", p + "mlp.down_proj.weight", (d, f)),
            ]
        return specs

    def write_metadata(self, writer, shape: TinyShape, vocab: int) -> None:
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.eps)
        writer.add_vocab_size(vocab)

    def check(self, shape: TinyShape, with_tokenizer: bool) -> None:
        super().check(shape, with_tokenizer)
        if shape.head_dim != shape.hidden // shape.heads:
            raise ValueError(
                f"a phi3 GGUF file cannot carry a head size ({shape.head_dim}) other than hidden // heads "
                f"({shape.hidden // shape.heads}): transformers' Phi3Config derives it."
            )


@register
class GPT2(Layout):
    family = arch = model_type = "gpt2"
    small = TinyShape(hidden=64, heads=4, kv_heads=4, intermediate=256, layers=3, context=1024)
    k_quant = TinyShape(hidden=256, heads=4, kv_heads=4, intermediate=1024, layers=2, context=1024)

    def tensors(self, shape: TinyShape, vocab: int, tied: bool) -> list[TensorSpec]:
        d, f = shape.hidden, shape.intermediate
        specs = [
            TensorSpec("token_embd.weight", "transformer.wte.weight", (vocab, d)),
            TensorSpec("position_embd.weight", "transformer.wpe.weight", (shape.context, d), "positions"),
            TensorSpec("output_norm.weight", "transformer.ln_f.weight", (d,), "norm"),
            TensorSpec("output_norm.bias", "transformer.ln_f.bias", (d,), "bias"),
        ]
        if not tied:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i in range(shape.layers):
            b, p = f"blk.{i}.", f"transformer.h.{i}."
            specs += [
                TensorSpec(b + "attn_norm.weight", p + "ln_1.weight", (d,), "norm"),
                TensorSpec(b + "attn_norm.bias", p + "ln_1.bias", (d,), "bias"),
                TensorSpec(b + "attn_qkv.weight", p + "attn.c_attn.weight", (3 * d, d), layout="transposed"),
                TensorSpec(b + "attn_qkv.bias", p + "attn.c_attn.bias", (3 * d,), "bias"),
                TensorSpec(b + "attn_output.weight", p + "attn.c_proj.weight", (d, d), layout="transposed"),
                TensorSpec(b + "attn_output.bias", p + "attn.c_proj.bias", (d,), "bias"),
                TensorSpec(b + "ffn_norm.weight", p + "ln_2.weight", (d,), "norm"),
                TensorSpec(b + "ffn_norm.bias", p + "ln_2.bias", (d,), "bias"),
                TensorSpec(b + "ffn_up.weight", p + "mlp.c_fc.weight", (f, d), layout="transposed"),
                TensorSpec(b + "ffn_up.bias", p + "mlp.c_fc.bias", (f,), "bias"),
                TensorSpec(b + "ffn_down.weight", p + "mlp.c_proj.weight", (d, f), layout="transposed"),
                TensorSpec(b + "ffn_down.bias", p + "mlp.c_proj.bias", (d,), "bias"),
            ]
        return specs

    def write_metadata(self, writer, shape: TinyShape, vocab: int) -> None:
        writer.add_block_count(shape.layers)
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_layer_norm_eps(shape.eps)

    def check(self, shape: TinyShape, with_tokenizer: bool) -> None:
        """transformers' gpt2 GGUF mapping reads n_layer, n_embd, n_head and the epsilon only; GPT2Config
        supplies the rest, and the file must agree with it."""
        expected = {
            "kv_heads": (shape.kv_heads, shape.heads, "GPT-2 has no grouped-query attention"),
            "head_dim": (shape.head_dim, shape.hidden // shape.heads, "GPT-2's head size is n_embd // n_head"),
            "intermediate": (shape.intermediate, 4 * shape.hidden, "GPT2Config's n_inner is None: 4 * n_embd"),
            "context": (shape.context, 1024, "context_length is read as n_ctx, not n_positions (default 1024)"),
        }
        wrong = [f"{k} {got} (expected {want}: {why})" for k, (got, want, why) in expected.items() if got != want]
        if not with_tokenizer:
            wrong.append("no tokenizer (transformers reads GPT-2's vocab_size from the token list only)")
        if wrong:
            raise ValueError(f"transformers would misread this gpt2 GGUF file: {'; '.join(wrong)}.")
