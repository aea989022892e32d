"""`paradecode-demo`: the main job, offline, on the demo model that ships with the project.

It exports `tools/demo_model` (a small Llama trained by tools/train_demo.py on the CPython standard
library, with exit heads trained by paradecode-train-heads) with its heads, generates Python code
with ParaDecode (printed as tokens are verified), then measures plain decoding (ar) and ParaDecode
side by side, interleaved on a few prompts, and reports tokens/s of both, early exits per layer
and whether every output matched ar token for token.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from paradecode.graphs.errors import UserInputError, run_command

DEMO_MODEL = Path(__file__).resolve().parent / "demo_model"
# No trailing newline: the tokenizer merges a newline with the next line's indentation ("\n    " is
# one token), so a prompt cut after "\n" asks for a continuation the model has rarely seen.
PROMPTS = (
    "def fibonacci(n):",
    'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):',
    'def read_config(path):\n    """Read a configuration file and return a dict."""',
    "import os\nimport sys\n\n\ndef main():",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paradecode-demo", description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=Path("out/demo"), help="export folder (default out/demo)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--repeat", type=int, default=3, metavar="R", help="interleaved repeats per prompt (default 3)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from paradecode.export.cli import quiet_dependency_logs

    quiet_dependency_logs()
    return run_command("paradecode-demo", lambda: run(args))[0]


def run(args) -> None:
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.tools.benchmarking import opened_with_ar_baselines

    if args.repeat < 1 or args.max_new_tokens < 2:
        raise UserInputError("--repeat must be at least 1 and --max-new-tokens at least 2.")
    heads = DEMO_MODEL / "heads.safetensors"
    if not (DEMO_MODEL / "model.safetensors").is_file() or not heads.is_file():
        raise UserInputError(
            f"the demo model is missing from {DEMO_MODEL}: restore it from git, or train one with "
            "`python -m paradecode.tools.train_demo` and `paradecode-train-heads`."
        )
    print(f"== exporting the demo model ({DEMO_MODEL}) with its trained exit heads", file=sys.stderr)
    result = export_model(
        ExportConfig(
            model=str(DEMO_MODEL), output=args.output, heads=heads, max_seq_len=384, fused_exits=True, force=True
        )
    )
    # export_model raises (and writes nothing) when a graph fails validation.
    print(
        f"   {len(result.manifest.subgraphs)} subgraphs validated against PyTorch in {result.seconds:.0f} s",
        file=sys.stderr,
    )
    with opened_with_ar_baselines(args.output) as (model, ar_models):
        thresholds = {e: t for e, t in model.manifest.thresholds.items() if t <= 1}
        print(
            f"\n== ParaDecode, exit layers {sorted(thresholds)} at thresholds "
            f"{ {e: round(t, 3) for e, t in thresholds.items()} }:\n",
            file=sys.stderr,
        )
        sys.stdout.write(PROMPTS[0])
        for piece in model.stream(PROMPTS[0], max_new_tokens=args.max_new_tokens):
            sys.stdout.write(piece.text)
            sys.stdout.flush()
        print("\n")
        print(measure(model, ar_models, args.max_new_tokens, args.repeat))


def measure(model, ar_models: dict, max_new_tokens: int, repeat: int) -> str:
    """Interleaved ar / ParaDecode runs on every prompt; the faster ar thread setting is the baseline."""
    from paradecode.tools import harness
    from paradecode.tools.benchmarking import generate_mode

    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    modes = [generate_mode(name, m, {"mode": "ar"}) for name, m in ar_models.items()]
    modes.append(generate_mode("paradecode", model, {}))
    results = harness.measure(modes, prompts, max_new_tokens=max_new_tokens, repeat=repeat)
    baseline = results.baseline
    speedup = results.speedup("paradecode", baseline, per="run")
    exits, accepted = results.exits("paradecode"), results.accepted("paradecode")
    runs = len(results.runs("paradecode"))
    matched = results.matches("paradecode", baseline)
    lines = [f"== side by side, {len(prompts)} prompts x {repeat} repeats, {max_new_tokens} new tokens, interleaved:"]
    for mode in modes:
        lines.append(f"   {mode.name:24} {results.tokens_per_second(mode.name).median:7.1f} tokens/s (median)")
    lines.append(f"   speedup over {baseline}: {speedup.median:.2f}x (min {speedup.min:.2f}, max {speedup.max:.2f})")
    lines.append(
        "   early exits per layer (accepted / proposed): "
        + ", ".join(f"layer {e}: {accepted.get(e, 0)}/{n}" for e, n in exits.items())
        + f"; rollbacks {results.rollbacks('paradecode')}"
    )
    lines.append(
        f"   output identical to ar token for token: {matched}/{runs} runs"
        + (" (yes)" if matched == runs else " (NO: please report this)")
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
