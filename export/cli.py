"""`paradecode-export MODEL -o DIR`: the command line over `export_model`.

Exit codes: 0 done; 1 the export failed validation, or the disk filled up while writing (nothing
written); 2 bad input, e.g. an unwritable -o, a truncated checkpoint or a garbled tokenizer.json
(nothing written); 3 a missing dependency or device, e.g. TensorRT (nothing written); 130
interrupted by Ctrl-C, 143 by SIGTERM (128 + the signal number; nothing written).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from paradecode.export.config import OPS, WEIGHT_SETTINGS, ExportConfig
from paradecode.export.known_models import known_models_help
from paradecode.graphs.arguments import positive_int
from paradecode.graphs.errors import run_command
from paradecode.graphs.quantization_manifest import ACTIVATIONS
from paradecode.graphs.tensors import DTYPES

FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ExportConfig)}  # the defaults live in ExportConfig

MODEL_HELP = (
    "a local folder written by save_pretrained, a .gguf file, a Hugging Face Hub id (owner/name), or a known "
    f"model's short name: {known_models_help()}"
)
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer numbers such as 2,4,6; got {text!r}"
        ) from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer number")
    return layers


def dtype_name(text: str) -> str:
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; expected one of {', '.join(DTYPES)}")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paradecode-export",
        description="Slice a Hugging Face decoder-only LM into an embedding graph, one graph per decoder layer "
        "(fixed-size KV cache written in place), early-exit heads and the final head; validate each "
        "against PyTorch with onnxruntime; write ONNX (and TensorRT engines) and a manifest.",
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="the export folder to create")
    parser.add_argument(
        "--exit-layers",
        type=layer_list,
        metavar="E1,E2,...",
        help="layers (1-based) after which an exit head predicts early; default: an even spread "
        "L/4, L/2, 3L/4, or the layers of --heads",
    )
    parser.add_argument(
        "--heads",
        type=Path,
        metavar="FILE",
        help="trained exit-head transforms (from paradecode-train-heads); default: identity heads "
        "(the model's own final norm and LM head)",
    )
    parser.add_argument(
        "--draft-head",
        type=Path,
        metavar="FILE",
        help="a draft head made for this model (export/draft_head.py): its graph is exported beside the layers "
        "and ParaDecode may propose its guesses; default: none",
    )
    parser.add_argument(
        "--dtype", type=dtype_name, default="float32", help=f"one of {', '.join(DTYPES)} (default float32)"
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHT_SETTINGS,
        default="auto",
        help="how weights are stored: auto (default) keeps a GGUF file's own 4/5/6/8-bit blocks exactly (Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and is float for other sources; float stores them in --dtype; "
        "int8/int4 quantize a float model's matrices blockwise with onnxruntime's quantizer",
    )
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=FIELD_DEFAULTS["activations"],
        help="what quantized weights multiply: int8 (default: every product's input rounded to 8 bits per block, as "
        "llama.cpp and onnxruntime-genai do; the fastest, and a position computes alike in any call, so ParaDecode's "
        "verifications and a batch's requests share calls with outputs equal to plain decoding's), int8-heads (the "
        "heads' only: the layers' float32 kernel gives a lone position other bits, so every position runs in a call "
        "of its own) or float (float32 everywhere: plain decoding within float32 rounding of PyTorch on the "
        "dequantized weights, every position in a call of its own)",
    )
    parser.add_argument(
        "--ops",
        choices=OPS,
        default="auto",
        help="which operators the norms and rotary embeddings use: fused (onnxruntime's RMSNormalization and "
        "RotaryEmbedding) or portable (elementwise operators, which TensorRT reads); the attention is standard "
        "operators in both; default auto: fused, portable with --engine tensorrt",
    )
    parser.add_argument(
        "--max-seq-len",
        type=positive_int,
        metavar="N",
        help="KV-cache length (default: the model's max_position_embeddings, at most 2048)",
    )
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=ExportConfig.max_batch,
        metavar="B",
        help="most requests a call decodes together, one row each: what a server batches "
        f"(default {ExportConfig.max_batch})",
    )
    parser.add_argument(
        "--max-unverified",
        type=positive_int,
        default=5,
        metavar="K",
        help="most unverified tokens in flight; sizes batched TensorRT profiles (default 5)",
    )
    parser.add_argument("--opset", type=int, default=24, help="ONNX opset (default 24, which TensorScatter needs)")
    parser.add_argument(
        "--engine",
        choices=("onnx", "tensorrt"),
        default="onnx",
        help="onnx (default), or also build TensorRT engines (needs TensorRT and a GPU)",
    )
    parser.add_argument(
        "--no-logits",
        action="store_true",
        help="heads output no logits (top-1 token and probability only): such an export decodes greedily but "
        "cannot sample",
    )
    parser.add_argument(
        "--fused-exits",
        action="store_true",
        help="also write layer_exit_e graphs (layer e and its trained exit head in one graph: one call instead "
        "of two, worth it where per-call overhead rivals a layer's compute; holds a second copy of layer e)",
    )
    parser.add_argument(
        "--no-segments",
        action="store_true",
        help="write no segment graphs (by default the layers between the exit layers are also written as one graph "
        "per range, composed from the layer graphs, so a token takes a few calls instead of one per layer)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, help="TensorRT engine and timing caches (default ~/.cache/paradecode)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace DIR if it exists and is an export (or an empty folder); any other folder is refused, not deleted",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print errors and the result only")
    parser.add_argument("-v", "--verbose", action="store_true", help="print debugging detail")
    return parser


def quiet_dependency_logs() -> None:
    """Keep only errors from torch, the ONNX exporter, transformers and the hub client.

    Import torch first: it sets up its own loggers on import, overriding levels set before.
    """
    import torch  # noqa: F401
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for noisy in ("torch", "onnxscript", "onnx_ir", "transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )

    def work():
        # Imported here, inside run_command, so that Ctrl-C or SIGTERM during the slow imports
        # (torch, transformers) ends as an interrupt too.
        from paradecode.export.pipeline import export_model

        quiet_dependency_logs()
        config = ExportConfig(
            model=args.model,
            output=args.output,
            exit_layers=args.exit_layers,
            heads=args.heads,
            draft_head=args.draft_head,
            dtype=args.dtype,
            weights=args.weights,
            activations=args.activations,
            ops=args.ops,
            max_seq_len=args.max_seq_len,
            max_batch=args.max_batch,
            max_unverified=args.max_unverified,
            opset=args.opset,
            engine=args.engine,
            force=args.force,
            with_logits=not args.no_logits,
            fused_exits=args.fused_exits,
            segments=not args.no_segments,
            cache_dir=args.cache_dir,
        )
        return export_model(config)

    code, result = run_command("paradecode-export", work, "interrupted; nothing was written")
    if code:
        return code
    if not args.quiet:
        print("validation:", file=sys.stderr)
        for line in result.checklist.lines():
            print("  " + line, file=sys.stderr)
    subgraphs = len(result.manifest.subgraphs)
    print(
        f"wrote {result.path} ({subgraphs} subgraphs, exit layers "
        f"{','.join(map(str, result.manifest.exit_layers))}) in {result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
