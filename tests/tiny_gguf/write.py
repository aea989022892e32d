"""Writing a tiny GGUF file of any registered family and block type, and what transformers reads back.

`write_tiny_gguf` returns a `TinyGGUF`: a dict of the Hugging Face weights (float32 numpy arrays
under Hugging Face names) that transformers should load from the file, bit for bit, with what was
written per GGUF tensor in `.tensors` (its raw type and bytes, `dequantize()`, the layout change).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFReader, GGUFWriter

from tests.tiny_gguf.blocks import FILE_TYPES, block_size, block_type, dequantized, random_tensor, weight_std
from tests.tiny_gguf.layouts import Layout, TensorSpec, TinyShape, layout_for
from tests.tiny_gguf.vocab import CHAT_TEMPLATE, VOCAB_SIZE, write_tokenizer

BlockTypes = str | GGMLQuantizationType | Mapping[str, str | GGMLQuantizationType]
DEFAULT_TYPE = "Q8_0"  # of matrices a `block_types` mapping does not name
# What a `block_types` mapping may name besides exact tensors: every matrix kind of every layout.
MATRIX_KINDS = (
    "token_embd",
    "output",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


@dataclass(frozen=True)
class TinyTensor:
    """One tensor as written: `spec` (names, shape, layout), its GGML type and its raw data.

    `data` is the array handed to GGUFWriter and read back by GGUFReader: uint8 [rows, bytes per row]
    of blocks for a quantized type, float32 / float16 values for F32 / F16.
    """

    spec: TensorSpec
    tensor_type: GGMLQuantizationType
    data: np.ndarray

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def hf_name(self) -> str:
        return self.spec.hf_name

    def dequantize(self) -> np.ndarray:
        """gguf.quants.dequantize of the raw data: float32 in the file's layout, shape `spec.shape`."""
        return dequantized(self.data, self.tensor_type).reshape(self.spec.shape)

    def hf_weight(self) -> np.ndarray:
        """The Hugging Face parameter transformers makes of it (the dequantized values, layout undone)."""
        return self.spec.to_hf(self.dequantize())


class TinyGGUF(dict):
    """Hugging Face name -> float32 weights transformers should read back, plus what was written.

    Attributes: `path`, `family`, `model_type` (what transformers builds: "llama" for a mistral file),
    `shape`, `tied`, `tensors` (GGUF name -> TinyTensor, in file order).
    """

    def __init__(
        self, path: Path, family: str, model_type: str, shape: TinyShape, tied: bool, tensors: dict[str, TinyTensor]
    ):
        super().__init__((t.hf_name, t.hf_weight()) for t in tensors.values())
        self.path, self.family, self.model_type = path, family, model_type
        self.shape, self.tied, self.tensors = shape, tied, tensors

    def tensor_for(self, hf_name: str) -> TinyTensor:
        """The GGUF tensor a Hugging Face parameter comes from."""
        return next(t for t in self.tensors.values() if t.hf_name == hf_name)


def as_mapping(block_types: BlockTypes) -> dict[str, str | GGMLQuantizationType]:
    """`block_types` as a mapping with a "default" entry."""
    given = dict(block_types) if isinstance(block_types, Mapping) else {"default": block_types}
    return {"default": DEFAULT_TYPE, **given}


def shape_for(family: str = "llama", block_types: BlockTypes = DEFAULT_TYPE) -> TinyShape:
    """The family's default tiny shape: rows of multiples of 256 when any chosen type is a K-quant."""
    layout = layout_for(family)
    k_quant = any(block_size(block_type(t)) == 256 for t in as_mapping(block_types).values())
    return layout.k_quant if k_quant else layout.small


def mixed_q4_k(layers: int, tied: bool) -> dict[str, str]:
    """Q4_K with Q6_K where llama.cpp's Q4_K_M puts it: the output matrix (token_embd when tied), and
    attn_v and ffn_down in the layers its `use_more_bits` picks (first and last eighth, every third)."""

    def more_bits(i: int) -> bool:
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    types = {"default": "Q4_K", "token_embd" if tied else "output": "Q6_K"}
    for i in filter(more_bits, range(layers)):
        types |= {f"blk.{i}.attn_v": "Q6_K", f"blk.{i}.ffn_down": "Q6_K"}
    return types


def matrix_types(block_types: BlockTypes, specs: list[TensorSpec], layers: int) -> dict[str, GGMLQuantizationType]:
    """GGUF name -> type of every matrix: an exact "blk.1.ffn_down" entry, else its kind's, else "default".

    A mapping may name kinds and layer tensors another family has (gpt2 has no attn_v), so that one
    mapping serves every family; any other name is refused as a typo.
    """
    given = as_mapping(block_types)
    per_layer = {f"blk.{i}.{kind}" for i in range(layers) for kind in MATRIX_KINDS}
    if unknown := sorted(set(given) - {"default", *MATRIX_KINDS, *per_layer}):
        raise ValueError(
            f"block_types names {unknown}, which are no matrix of this file; expected 'default', a kind "
            f"({', '.join(MATRIX_KINDS)}) or a tensor such as 'blk.{layers - 1}.ffn_down'."
        )
    matrices = [s for s in specs if s.role == "matrix"]
    return {s.name: block_type(given.get(s.base_name, given.get(s.kind, given["default"]))) for s in matrices}


def float_tensor(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Norm weights near 1, biases near 0, learned positions like token embeddings: F32, as llama.cpp stores them."""
    noise = rng.standard_normal(spec.shape)
    spread = {"norm": 0.1, "bias": 0.05, "positions": weight_std(spec.shape[-1])}[spec.role]
    return ((1.0 if spec.role == "norm" else 0.0) + spread * noise).astype(np.float32)


def write_tiny_gguf(
    path: Path,
    shape: TinyShape | None = None,
    *,
    family: str = "llama",
    block_types: BlockTypes = DEFAULT_TYPE,
    seed: int = 0,
    with_tokenizer: bool = True,
    add_bos: bool = False,
    tied: bool = True,
    metadata_shape: TinyShape | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> TinyGGUF:
    """Write a tiny random `family` model as llama.cpp would; return what transformers should read back.

    `shape` defaults to `shape_for(family, block_types)`. `block_types` is one type for every matrix
    ("Q4_K") or a mapping from "default", a kind ("token_embd", "attn_v", ...) or a tensor
    ("blk.1.ffn_down") to a type; norms, biases and GPT-2's positions are F32. `tied` leaves out
    output.weight (transformers then ties lm_head to the embedding). `metadata_shape` writes other sizes
    into the metadata than the tensors have (a damaged or hostile file: `block_count` 1,000,000 over 4 blocks);
    `chat_template` replaces the tokenizer's chat template.
    """
    layout: Layout = layout_for(family)
    shape = shape or shape_for(family, block_types)
    layout.check(shape, with_tokenizer)
    specs = layout.tensors(shape, VOCAB_SIZE, tied)
    types = matrix_types(block_types, specs, shape.layers)
    rng = np.random.default_rng(seed)
    tensors: dict[str, TinyTensor] = {}
    for spec in specs:
        if spec.name in types:
            data = random_tensor(types[spec.name], spec.shape, rng, spec.name)
            tensors[spec.name] = TinyTensor(spec, types[spec.name], data)
        else:
            tensors[spec.name] = TinyTensor(spec, GGMLQuantizationType.F32, float_tensor(spec, rng))

    writer = GGUFWriter(str(path), layout.arch)
    writer.add_name(f"paradecode tiny {family}")
    layout.write_metadata(writer, metadata_shape or shape, VOCAB_SIZE)
    writer.add_file_type(FILE_TYPES[block_type(as_mapping(block_types)["default"])])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    if with_tokenizer:
        write_tokenizer(writer, add_bos, chat_template)
    for t in tensors.values():
        quantized = t.data.dtype == np.uint8
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(Path(path), family, layout.model_type, shape, tied, tensors)


def read_gguf_tensors(path: Path) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    """GGUF name -> (type, raw data) as the file holds them (GGUFReader; data as `TinyTensor.data`)."""
    reader = GGUFReader(str(path))
    return {t.name: (GGMLQuantizationType(t.tensor_type), np.array(t.data)) for t in reader.tensors}
