"""Tiny GGUF files written in-process, the way llama.cpp's converter and quantizer write them, for every
registered family and every GGUF block type the exporter handles.

    weights = write_tiny_gguf(path, family="qwen2", block_types="Q4_K")

writes random weights under llama.cpp's tensor names and layouts for that architecture
(`layouts.py`), matrices in the chosen block types (`blocks.py`: quantized by gguf.quants, or random
valid K-quant blocks), norms and biases F32, and a byte-level BPE tokenizer with a chat template
(`vocab.py`). It returns the Hugging Face weights transformers should read back, bit for bit, with
the raw blocks of every tensor (`write.py`).
"""

from tests.tiny_gguf.blocks import BLOCK_TYPES, K_QUANTS, QUANTIZED_BY_GGUF, pack_k_scales
from tests.tiny_gguf.layouts import LAYOUTS, TensorSpec, TinyShape, permute_for_gguf, unpermute_from_gguf
from tests.tiny_gguf.vocab import BOS_ID, CHAT_TEMPLATE, EOS_ID, VOCAB_SIZE
from tests.tiny_gguf.write import TinyGGUF, TinyTensor, mixed_q4_k, read_gguf_tensors, shape_for, write_tiny_gguf

TinyLlama = TinyShape  # the name tests written before the other families use

__all__ = [
    "BLOCK_TYPES",
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EOS_ID",
    "K_QUANTS",
    "LAYOUTS",
    "QUANTIZED_BY_GGUF",
    "VOCAB_SIZE",
    "TensorSpec",
    "TinyGGUF",
    "TinyLlama",
    "TinyShape",
    "TinyTensor",
    "mixed_q4_k",
    "pack_k_scales",
    "permute_for_gguf",
    "read_gguf_tensors",
    "shape_for",
    "unpermute_from_gguf",
    "write_tiny_gguf",
]
