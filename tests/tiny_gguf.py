"""A tiny llama written as a GGUF file in-process, the way llama.cpp's converter writes one.

Weights are random, in Hugging Face's layout, then written under llama.cpp's tensor names
(`token_embd.weight`, `blk.{i}.attn_q.weight`, ...) with the rows of Q and K permuted as
`convert_hf_to_gguf.py` permutes them (transformers undoes that when it reads the file). Matrices are
stored as Q8_0 blocks (real dequantization on load), norms as F32. The tokenizer is a byte-level
BPE ("gpt2") with every byte, a few merges, three control tokens and a ChatML chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġt", "he"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "s"),
    ("a", "t"),
    ("Ġ", "f"),
    ("d", "e"),
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True)
class TinyLlama:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 96
    layers: int = 4
    context: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the alphabet of a byte-level BPE vocabulary)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types (3 control, 1 normal) and merges."""
    tokens = [*SPECIALS, *bytes_to_unicode().values(), *(a + b for a, b in MERGES)]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def hf_weights(shape: TinyLlama, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face Llama names and layouts."""
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)  # large enough for varied greedy output

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    d, hd, f = shape.hidden, shape.head_dim, shape.intermediate
    weights = {"model.embed_tokens.weight": matrix(vocab, d), "model.norm.weight": norm(d)}
    if not shape.tied:
        weights["lm_head.weight"] = matrix(vocab, d)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": matrix(shape.heads * hd, d),
            p + "self_attn.k_proj.weight": matrix(shape.kv_heads * hd, d),
            p + "self_attn.v_proj.weight": matrix(shape.kv_heads * hd, d),
            p + "self_attn.o_proj.weight": matrix(d, shape.heads * hd),
            p + "post_attention_layernorm.weight": norm(d),
            p + "mlp.gate_proj.weight": matrix(f, d),
            p + "mlp.up_proj.weight": matrix(f, d),
            p + "mlp.down_proj.weight": matrix(d, f),
        }
    return weights


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of Q/K rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_tensors(shape: TinyLlama, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same weights under llama.cpp's names, Q and K rows permuted."""
    out = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "output_norm.weight": weights["model.norm.weight"],
    }
    if not shape.tied:
        out["output.weight"] = weights["lm_head.weight"]
    for i in range(shape.layers):
        for hf, gguf in GGUF_NAMES.items():
            w = weights[f"model.layers.{i}.{hf}.weight"]
            if gguf == "attn_q":
                w = permute_for_gguf(w, shape.heads)
            elif gguf == "attn_k":
                w = permute_for_gguf(w, shape.kv_heads)
            out[f"blk.{i}.{gguf}.weight"] = w
    return out


def q8_roundtrip(w: np.ndarray) -> np.ndarray:
    """What a tensor stored as Q8_0 reads back as."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if w.ndim != 2:
        return w
    return dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)


def write_tiny_gguf(
    path: Path, shape: TinyLlama = TinyLlama(), *, seed: int = 0, with_tokenizer: bool = True, add_bos: bool = False
) -> dict[str, np.ndarray]:
    """Write the file; return the Hugging Face weights as transformers should read them back (after Q8_0)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    tokens, types, merges = vocabulary()
    weights = hf_weights(shape, len(tokens), seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("paradecode tiny llama")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(7)  # MOSTLY_Q8_0
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_pad_token_id(EOS_ID)
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, w in gguf_tensors(shape, weights).items():
        if w.ndim == 2:
            writer.add_tensor(name, quantize(w, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: q8_roundtrip(w) for name, w in weights.items()}
