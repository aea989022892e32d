"""`paradecode-parity-report DIR`: ParaDecode vs ar, token for token, in every overlap mode.

For a device and backend (the GPU run of tools/gpu_measure.sh uses torch on CUDA), decodes every prompt
with `ar` and with ParaDecode at several thresholds in each overlap mode, and reports where the two
differ: the first differing position and ar's top-1/top-2 logit margin there (teacher-forced on ar's own
prefix through the export's graphs). docs/design.md §3 allows a difference only at a near tie, where a batched
product rounds differently from a single-token one; in bfloat16 such ties are wider, and the margin says
how near each one was. Writes JSON (--json) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from paradecode.graphs.errors import run_command
from paradecode.runtime import load
from paradecode.runtime.config import OVERLAPS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paradecode-parity-report", description=__doc__.splitlines()[0])
    parser.add_argument("export", metavar="DIR", help="a folder written by paradecode-export")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", metavar="FILE|NAME", help="as paradecode-bench takes them (default: as it)")
    parser.add_argument("--per-category", type=int, default=2, metavar="N")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--thresholds", default="0,0.5,default", help="comma-separated; 'default' is the export's own")
    parser.add_argument("--json", type=Path, metavar="FILE")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code, table = run_command("paradecode-parity-report", lambda: report(args))
    if code == 0:
        print(table)
    return code


def teacher_forced(model, sequence: list[int]) -> dict[str, torch.Tensor]:
    """The final head's outputs after every position of `sequence`, from the export's own subgraphs: one
    prefill-like call per layer over the whole sequence, in a cache of its own (the model's is untouched)."""
    backend = model.backend
    cache = backend.allocate_cache()
    cache.reserve(len(sequence))
    positions = torch.arange(len(sequence), device=backend.device)[None]
    feeds = {"input_ids": torch.tensor([sequence], device=backend.device)}
    if backend.spec.positions == "learned":
        feeds["positions"] = positions
    hidden = backend.run("embed", feeds)["hidden"]
    for layer in range(1, backend.spec.num_layers + 1):
        key, value = cache.layer(layer)
        feeds = {"hidden": hidden, "positions": positions, "past_key": key, "past_value": value}
        hidden = backend.run(f"layer_{layer}", feeds)["hidden_out"]
    return backend.run("final", {"hidden": hidden})


def scorer(model):
    """prompt+tokens -> (top-1 per position, top-1/top-2 margin per position)."""

    def score(sequence: list[int]) -> tuple[list[int], list[float]]:
        out = teacher_forced(model, sequence)
        return out["token"].reshape(-1).tolist(), out["margin"].float().reshape(-1).tolist()

    return score


def report(args) -> str:
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.tools.bench import default_prompts, first_of_each_category, prompt_ids_of

    model = load(args.export, backend=args.backend, device=args.device)
    try:
        prompts = load_prompts(args.prompts) if args.prompts else default_prompts(model)
        prompts = first_of_each_category(prompts, args.per_category)
        ids = prompt_ids_of(model, [p.prompt for p in prompts])
        score = scorer(model)
        rows = []
        thresholds = [t.strip() for t in args.thresholds.split(",")]
        for prompt, prompt_ids in zip(prompts, ids):
            ar = model.generate(prompt_ids=prompt_ids, max_new_tokens=args.max_new_tokens, mode="ar", ignore_eos=True)
            for overlap in OVERLAPS:
                if overlap == "auto":
                    continue
                for threshold in thresholds:
                    settings = {} if threshold == "default" else {"thresholds": float(threshold)}
                    ours = model.generate(
                        prompt_ids=prompt_ids,
                        max_new_tokens=args.max_new_tokens,
                        overlap=overlap,
                        ignore_eos=True,
                        **settings,
                    )
                    rows.append(compare(prompt.category, overlap, threshold, prompt_ids, ar.token_ids, ours, score))
        payload = {"export": str(args.export), "device": device_name(args.device), "dtype": model.manifest.dtype}
        payload["rows"] = rows
    finally:
        model.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1))
    return table(payload)


def compare(category, overlap, threshold, prompt_ids, ar_tokens, ours, score) -> dict:
    row = {
        "category": category,
        "overlap": overlap,
        "threshold": threshold,
        "tokens": len(ours.token_ids),
        "identical": ours.token_ids == ar_tokens,
        "rollbacks": ours.stats.rollbacks,
        "early_accepted": sum(ours.stats.accepted_per_layer.values()),
    }
    if not row["identical"]:
        first = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ar_tokens)) if a != b), None)
        if first is None:
            first = min(len(ours.token_ids), len(ar_tokens))
        _, margins = score(list(prompt_ids) + list(ar_tokens))
        row["first_difference"] = first
        row["ar_margin_there"] = margins[len(prompt_ids) - 1 + first] if first < len(ar_tokens) else None
    return row


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"


def table(payload: dict) -> str:
    lines = [
        f"parity on {payload['device']} ({payload['dtype']}), {payload['export']}",
        "| overlap | threshold | runs | identical | differences (first position: ar margin) |",
        "| --- | --- | --- | --- | --- |",
    ]
    groups: dict = {}
    for row in payload["rows"]:
        groups.setdefault((row["overlap"], row["threshold"]), []).append(row)
    for (overlap, threshold), rows in groups.items():
        same = sum(r["identical"] for r in rows)
        diffs = ", ".join(f"{r['first_difference']}: {r['ar_margin_there']:.3g}" for r in rows if not r["identical"])
        lines.append(f"| {overlap} | {threshold} | {len(rows)} | {same} | {diffs or '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
