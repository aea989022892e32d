"""What an export records about its quantized weights: each weight's blockwise format, the activations.

The form itself (how stored integers, scales, zero points and minima make a weight) and the tensors that
hold it are in `graphs.quantized_weights`; this module is what the manifest reads and writes, without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from paradecode.graphs.errors import ManifestError
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import HEAD_SUBGRAPHS
from paradecode.graphs.untrusted import json_field, json_integer, json_object, json_string, show

BITS = (4, 8)
BLOCK_SIZES = (16, 32, 64, 128, 256)
FLOAT_DTYPES = ("float16", "float32")
PARTS = ("qweight", "scales", "zero_points", "mins")
# Weights that may be stored quantized (canonical names, graphs/modules.py): every matrix a token's
# compute reads. Norms, biases, rotary frequencies, learned positions and the exit heads' trained
# transforms stay float.
QUANTIZABLE = re.compile(
    r"layers\.\d+\.attn\.[qkvo]\.weight|layers\.\d+\.mlp\.(gate|up|down)\.weight"
    r"|embed\.tokens\.weight|unembed\.weight|exits\.unembed"
)
# What the graphs compute with: "int8" (the default) rounds every quantized product's input to int8 per block
# (onnxruntime's accuracy_level 4, as onnxruntime-genai's CPU models and llama.cpp do): the fastest, its kernel
# computes a row alike in a call of any size on the CPUs measured (runtime/row_exactness.py probes it on each
# machine), and SmolLM2's perplexity moves +0.15% against float (docs/export.md). "float" keeps the activations in
# float32 (checked against PyTorch on the dequantized weights), whose kernel gives a lone row other bits than
# several and dequantizes the whole matrix for a call of several rows (SmolLM2's Q8_0 head: 8.1 ms for 2 positions
# against 2.8 for 1, tools/results/cpu-2core/call-costs-smollm2-activations.md), so the row probe runs every
# position of such layers in a call of its own. "int8-heads" rounds only the heads' (the final head's and the exit
# heads' own graphs; a fused layer_exit graph keeps float activations), the layers' float32.
ACTIVATIONS = ("float", "int8-heads", "int8")


def quantizable(name: str) -> bool:
    return QUANTIZABLE.fullmatch(name) is not None


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored: what the manifest records for it."""

    source: str  # a GGUF block type ("Q4_1", "Q6_K", ...) or the quantizer's setting ("int4", "int8")
    bits: int
    block_size: int
    shape: tuple[int, int]  # (N, K)
    scales: str  # the stored scales' dtype name
    zero_points: bool
    mins: str | None  # the stored minima's dtype name; None: no minimum

    def __post_init__(self) -> None:
        problems = []
        if self.bits not in BITS:
            problems.append(f"bits {self.bits} (expected one of {BITS})")
        if self.block_size not in BLOCK_SIZES:
            problems.append(f"block_size {self.block_size} (expected one of {BLOCK_SIZES})")
        if len(self.shape) != 2 or any(not isinstance(d, int) or d < 1 for d in self.shape):
            problems.append(f"shape {list(self.shape)} (expected [N, K], both positive)")
        if self.scales not in FLOAT_DTYPES:
            problems.append(f"scales {self.scales!r} (expected one of {list(FLOAT_DTYPES)})")
        if self.mins is not None and self.mins not in FLOAT_DTYPES:
            problems.append(f"mins {self.mins!r} (expected null or one of {list(FLOAT_DTYPES)})")
        if problems:
            raise ValueError("a quantized weight format has " + "; ".join(problems) + ".")

    @property
    def blocks(self) -> int:
        return -(-self.shape[1] // self.block_size)

    @property
    def blob(self) -> int:
        """Bytes per block of quantized values."""
        return self.block_size * self.bits // 8

    def stored_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The shape and dtype name of each stored part, by suffix."""
        n, blocks = self.shape[0], self.blocks
        parts = {"qweight": ((n, blocks, self.blob), "uint8"), "scales": ((n, blocks), self.scales)}
        if self.zero_points:
            parts["zero_points"] = ((n, -(-blocks * self.bits // 8)), "uint8")
        if self.mins is not None:
            parts["mins"] = ((n, blocks), self.mins)
        return parts

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "bits": self.bits,
            "block_size": self.block_size,
            "shape": list(self.shape),
            "scales": self.scales,
            "zero_points": self.zero_points,
            "mins": self.mins,
        }

    @classmethod
    def from_dict(cls, value: Any, where: str) -> WeightFormat:
        data = json_object(value, where)
        shape = json_field(data, "shape", f"{where}.")
        if not isinstance(shape, list) or len(shape) != 2:
            raise ManifestError(f"{where}.shape is {show(shape)}; expected [N, K].")
        zero_points = json_field(data, "zero_points", f"{where}.")
        if not isinstance(zero_points, bool):
            raise ManifestError(f"{where}.zero_points is {show(zero_points)}; expected true or false.")
        mins = data.get("mins")
        try:
            return cls(
                source=json_string(json_field(data, "source", f"{where}."), f"{where}.source"),
                bits=json_integer(json_field(data, "bits", f"{where}."), f"{where}.bits"),
                block_size=json_integer(json_field(data, "block_size", f"{where}."), f"{where}.block_size"),
                shape=tuple(json_integer(d, f"{where}.shape[{i}]", minimum=1) for i, d in enumerate(shape)),
                scales=json_string(json_field(data, "scales", f"{where}."), f"{where}.scales", FLOAT_DTYPES),
                zero_points=zero_points,
                mins=None if mins is None else json_string(mins, f"{where}.mins", FLOAT_DTYPES),
            )
        except ValueError as err:
            raise ManifestError(f"{where}: {err}") from err


@dataclass(frozen=True)
class Quantization:
    """What the manifest records about an export's quantized weights: the activations setting and each
    quantized weight's format, by canonical name (weights not listed are stored in the export's dtype)."""

    activations: str
    weights: dict[str, WeightFormat]

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r} is not one of {ACTIVATIONS}.")
        bad = sorted(name for name in self.weights if not quantizable(name))
        if bad:
            raise ValueError(f"weights {bad} cannot be quantized (only {QUANTIZABLE.pattern}).")

    def activations_of(self, kind: str) -> str:
        """What a subgraph of this kind (graphs/tensors.py KINDS) computes with: "float" or "int8" (a draft head's
        weights are never quantized: float)."""
        if kind in ("draft", "draft_reduce"):
            return "float"
        if self.activations == "int8-heads":
            return "int8" if kind in HEAD_SUBGRAPHS else "float"
        return self.activations

    def sources(self) -> dict[str, int]:
        """How many weights come from each source format ("Q4_1": 210, ...)."""
        counts: dict[str, int] = {}
        for fmt in self.weights.values():
            counts[fmt.source] = counts.get(fmt.source, 0) + 1
        return dict(sorted(counts.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "activations": self.activations,
            "weights": {name: fmt.to_dict() for name, fmt in sorted(self.weights.items())},
        }

    @classmethod
    def from_dict(cls, value: Any, where: str = "quantization") -> Quantization:
        data = json_object(value, where)
        weights = json_object(json_field(data, "weights", f"{where}."), f"{where}.weights")
        try:
            return cls(
                activations=json_string(
                    json_field(data, "activations", f"{where}."), f"{where}.activations", ACTIVATIONS
                ),
                weights={
                    json_string(name, f"a {where}.weights key"): WeightFormat.from_dict(fmt, f"{where}.weights.{name}")
                    for name, fmt in weights.items()
                },
            )
        except ValueError as err:
            raise ManifestError(f"{where}: {err}") from err


def canonical_shape(spec: ModelSpec, name: str, head_vocab: int | None) -> tuple[int, int] | None:
    """The [N, K] shape a quantizable weight of this model has, None if the model has no such weight."""
    d, q_out, kv_out = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    if name == "embed.tokens.weight":
        return (spec.vocab_size, d)
    if name == "unembed.weight":
        return None if spec.tie_word_embeddings else (spec.vocab_size, d)
    if name == "exits.unembed":
        return None if head_vocab is None else (head_vocab, d)
    match = re.fullmatch(r"layers\.(\d+)\.(attn|mlp)\.(\w+)\.weight", name)
    if match is None or not 1 <= int(match.group(1)) <= spec.num_layers:
        return None
    shapes = {
        "q": (q_out, d),
        "k": (kv_out, d),
        "v": (kv_out, d),
        "o": (d, q_out),
        "up": (spec.intermediate_size, d),
        "down": (d, spec.intermediate_size),
    }
    if spec.mlp == "gated":
        shapes["gate"] = (spec.intermediate_size, d)
    return shapes.get(match.group(3))
