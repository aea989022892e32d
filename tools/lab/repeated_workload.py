"""`python tools/lab/repeated_workload.py DIR`: the same requests twice through one loaded model, as a
service sees them, to show what lookup over earlier requests' outputs (`lookup_shared`) adds.

Three modes, interleaved request by request on one model: `ar`; ParaDecode with the defaults, lookup over each
request's own prompt and output (`own`); and the same with shared lookup (`shared`: its index of outputs is empty at
the start, then hold what every `shared` request before produced). Pass 1 sends every prompt once (for `shared`,
earlier requests of the pass are other prompts: the effect on a workload that does not repeat); pass 2 sends
them all again (it repeats). Per pass and mode: tokens/s (new tokens over decoding seconds, summed over the
requests), over ar's, lookup tokens accepted of proposed, and how many outputs equal ar's.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

from paradecode.export.prompt_sets import NAMES_HELP
from paradecode.graphs.errors import run_command

PROG = "python tools/lab/repeated_workload.py"
MODES = {
    "ar": {"mode": "ar"},
    "own": {"mode": "paradecode", "lookup_shared": False},
    "shared": {"mode": "paradecode", "lookup_shared": True},
}

logger = logging.getLogger("paradecode.repeated_workload")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("export", metavar="DIR", help="a folder written by paradecode-export")
    parser.add_argument("--prompts", metavar="FILE|NAME", help=f"as paradecode-bench's, {NAMES_HELP}; default eval")
    parser.add_argument("--per-category", type=int, metavar="N", help="the first N prompts of each category")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure as JSON")
    return parser


def measure(model, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """{pass: {mode: figures}} of two passes over `prompts`, the modes interleaved request by request."""
    model.shared_index.clear()
    passes: dict[str, dict[str, dict]] = {}
    reference: list[list[int]] = []
    for number in (1, 2):
        totals = {mode: {"tokens": 0, "seconds": 0.0, "proposed": 0, "accepted": 0, "same_as_ar": 0} for mode in MODES}
        for i, ids in enumerate(prompts):
            for mode, settings in MODES.items():
                result = model.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, **settings)
                stats, row = result.stats, totals[mode]
                if mode == "ar" and number == 1:
                    reference.append(result.token_ids)
                row["tokens"] += max(stats.new_tokens - 1, 0)  # after the prefill's first token, as tokens/s counts
                row["seconds"] += stats.decode_seconds
                row["proposed"] += stats.lookup_proposed
                row["accepted"] += stats.lookup_accepted
                row["same_as_ar"] += result.token_ids == reference[i]
            logger.info("pass %d: %d/%d prompts", number, i + 1, len(prompts))
        ar = totals["ar"]["tokens"] / totals["ar"]["seconds"]
        for row in totals.values():
            row["tokens_per_second"] = row["tokens"] / row["seconds"] if row["seconds"] else None
            row["vs_ar"] = row["tokens_per_second"] / ar if row["tokens_per_second"] else None
        passes[str(number)] = totals
    return {"passes": passes, "prompts": len(prompts), "shared_tokens": len(model.shared_index)}


def markdown(figures: dict[str, Any]) -> str:
    lines = [
        f"{figures['prompts']} requests per pass; tokens/s = new tokens after the first / decoding seconds, summed",
        "",
        "| pass | mode | tokens/s | x ar | lookup accepted / proposed | outputs equal to ar's |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for number, totals in figures["passes"].items():
        for mode, row in totals.items():
            lines.append(
                f"| {number} | {mode} | {row['tokens_per_second']:.1f} | {row['vs_ar']:.2f} | "
                f"{row['accepted']} / {row['proposed']} | {row['same_as_ar']} of {figures['prompts']} |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace, command: str) -> str:
    from paradecode.export.files import check_file_writable
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.runtime import load
    from paradecode.tools.bench import default_prompts, first_of_each_category, prompt_ids_of
    from paradecode.tools.bench_modes import machine
    from paradecode.tools.reporting import save_json

    if args.json is not None:
        check_file_writable(args.json, "--json")
    with load(args.export) as model:
        labelled = load_prompts(args.prompts) if args.prompts else default_prompts(model)
        if args.per_category is not None:
            labelled = first_of_each_category(labelled, args.per_category)
        prompts = prompt_ids_of(model, [p.prompt for p in labelled])
        figures = measure(model, prompts, args.max_new_tokens)
    if args.json is not None:
        save_json(args.json, {"command": command, "machine": machine(), "modes": MODES, **figures})
        logger.info("wrote %s", args.json)
    return markdown(figures)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    command = shlex.join([PROG, *argv])
    code, table = run_command(PROG, lambda: run(args, command), "interrupted; nothing was written")
    if code == 0:
        print(table)
    return code


if __name__ == "__main__":
    sys.exit(main())
