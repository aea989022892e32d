"""`paradecode-demo`: the main job on a built-in model, with no download.

Builds a small Llama-family model in-process (fixed seed, random weights) and exports it with
`paradecode-export`'s library call, printing the per-subgraph progress and the validation checklist.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

DEMO_CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def build_demo_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**DEMO_CONFIG)).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paradecode-demo", description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=Path("out/demo"), help="export folder (default out/demo)")
    args = parser.parse_args(argv)
    from paradecode.export.cli import main as export_main

    with tempfile.TemporaryDirectory(prefix="paradecode-demo-") as tmp:
        model = build_demo_model(Path(tmp) / "demo-llama")
        logging.getLogger(__name__).info("built the demo model (Llama, 6 layers, hidden 128) in %s", model)
        return export_main([str(model), "-o", str(args.output), "--force"])


if __name__ == "__main__":
    sys.exit(main())
