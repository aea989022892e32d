"""`ExportConfig`: every setting of an export, validated on construction; the defaults live here only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.quantization_manifest import ACTIVATIONS
from paradecode.graphs.tensors import DTYPES

ENGINES = ("onnx", "tensorrt")
WEIGHT_SETTINGS = ("auto", "float", "int8", "int4")  # how weights are stored: export/weight_storage.py
# Which operators the graphs use: "fused" (onnxruntime's RMSNormalization and RotaryEmbedding for the norms and rotary
# embeddings) or "portable" (elementwise operators, which TensorRT's parser reads); the attention is the same standard
# operators in both (export/attention.py). "auto": fused for --engine onnx, portable for tensorrt.
OPS = ("auto", "fused", "portable")
MIN_OPSET = 24  # TensorScatter, the in-place KV-cache write, is an opset-24 operator
MAX_OPSET = 24  # the highest opset the exporter and onnxruntime are tested with here
DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_THRESHOLD = 0.75  # the paper's main setting (docs/design.md §2); calibration replaces it per layer


@dataclass(frozen=True)
class ExportConfig:
    model: str
    output: Path
    exit_layers: tuple[int, ...] | None = None  # None: an even spread (L/4, L/2, 3L/4), or the heads file's
    heads: Path | None = None
    draft_head: Path | None = None  # a draft head's file (export/draft_head.py): its graph is exported too
    dtype: str = "float32"
    # auto: a GGUF file's own quantized blocks kept exactly, float for other sources; float: dense in `dtype`;
    # int8 / int4: a float model's matrices quantized blockwise by onnxruntime's quantizer (export/weight_storage.py)
    weights: str = "auto"
    # what quantized weights multiply (graphs/quantization_manifest.py ACTIVATIONS): int8 (every product's input rounded
    # to 8 bits per block, as llama.cpp and onnxruntime-genai do: the fastest, and on the CPUs measured a position's
    # bits are the same in any call, so ParaDecode's verifications and a batch's rows share calls exactly; SmolLM2's
    # perplexity +0.15% against float, docs/export.md), int8-heads (int8 in the heads, float32 in the layers, whose CPU
    # kernel gives a lone position other bits: every position then runs in a call of its own) or float (float32
    # everywhere: plain decoding within float32 rounding of PyTorch on the dequantized weights, and as int8-heads)
    activations: str = "int8"
    ops: str = "auto"
    max_seq_len: int | None = None  # None: the model's max_position_embeddings, at most DEFAULT_MAX_SEQ_LEN
    # rows a call may carry (independent requests, one token each: graphs/tensors.py): what a server batches. A
    # symbolic batch costs a batch-1 call nothing measurable (SmolLM2, 62.0 vs 60.1 tokens/s of plain decoding)
    max_batch: int = 8
    max_unverified: int = 5
    opset: int = MIN_OPSET
    engine: str = "onnx"
    force: bool = False
    with_logits: bool = True  # heads also output their logits: what sampling needs (greedy never reads them)
    # Also write layer_exit_e (layer e and its trained exit head in one graph): one call instead of two, for
    # models whose per-call overhead rivals a layer's compute; it holds a second copy of layer e and the head.
    fused_exits: bool = False
    # Also write segment graphs (the layers between the exit layers, each range in one graph, composed from the
    # layer graphs): a token then takes a few calls instead of one per layer.
    segments: bool = True
    cache_dir: Path | None = None  # TensorRT engine and timing caches; None: ~/.cache/paradecode

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", Path(self.output))
        if self.heads is not None:
            object.__setattr__(self, "heads", Path(self.heads))
        if self.draft_head is not None:
            object.__setattr__(self, "draft_head", Path(self.draft_head))
        if self.dtype not in DTYPES:
            raise UserInputError(f"dtype {self.dtype!r} is not supported; expected one of {', '.join(DTYPES)}.")
        if self.weights not in WEIGHT_SETTINGS:
            raise UserInputError(
                f"weights {self.weights!r} is not supported; expected one of {', '.join(WEIGHT_SETTINGS)}."
            )
        if self.activations not in ACTIVATIONS:
            raise UserInputError(
                f"activations {self.activations!r} is not supported; expected one of {', '.join(ACTIVATIONS)}."
            )
        if self.weights in ("int8", "int4") and self.dtype != "float32":
            raise UserInputError(
                f"--weights {self.weights} exports compute in float32 (onnxruntime's MatMulNBits on the CPU); "
                f"--dtype {self.dtype} is for dense exports: pass --weights float with it, or drop --dtype."
            )
        if self.ops not in OPS:
            raise UserInputError(f"ops {self.ops!r} is not supported; expected one of {', '.join(OPS)}.")
        if self.ops == "fused" and self.engine == "tensorrt":
            raise UserInputError(
                "--ops fused uses onnxruntime's RMSNormalization and RotaryEmbedding operators, which TensorRT may not "
                "build: "
                "with --engine tensorrt leave --ops at auto or pass --ops portable."
            )
        if self.engine not in ENGINES:
            raise UserInputError(f"engine {self.engine!r} is not supported; expected one of {', '.join(ENGINES)}.")
        if not MIN_OPSET <= self.opset <= MAX_OPSET:
            raise UserInputError(
                f"opset {self.opset} is not supported: the in-place KV-cache write is ONNX TensorScatter, "
                f"an opset-{MIN_OPSET} operator, and opsets above {MAX_OPSET} are untested. Use --opset {MIN_OPSET}."
            )
        for name in ("max_batch", "max_unverified"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserInputError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise UserInputError(f"max_seq_len must be an integer of at least 2, got {self.max_seq_len!r}.")
        if self.exit_layers is not None:
            layers = tuple(self.exit_layers)
            if not layers:
                raise UserInputError("exit_layers is empty: ParaDecode needs at least one exit layer.")
            if any(not isinstance(e, int) for e in layers):
                raise UserInputError(f"exit layers are layer numbers counted from 1, got {list(layers)}.")
            if len(set(layers)) != len(layers):
                raise UserInputError(f"exit layers repeat: {list(layers)}.")
            object.__setattr__(self, "exit_layers", tuple(sorted(layers)))

    @property
    def resolved_ops(self) -> str:
        """`ops` with `auto` resolved: fused graphs for onnxruntime, portable ones where TensorRT builds engines."""
        if self.ops != "auto":
            return self.ops
        return "portable" if self.engine == "tensorrt" else "fused"


def default_exit_layers(num_layers: int) -> tuple[int, ...]:
    """An even spread, L/4, L/2, 3L/4 (rounded, distinct, below the last layer), at least one."""
    layers = sorted({min(max(1, int(num_layers * k / 4 + 0.5)), num_layers - 1) for k in (1, 2, 3)})
    return tuple(layers)
