"""`paradecode-train-heads MODEL -o FILE`: distil cheap exit heads and calibrate them for speed.

The heads predict over a reduced vocabulary (the tokens the final layer predicts most often, as
many as `--head-budget` decoder layers' parameters allow); the exit layers and thresholds are the
ones with the best expected tokens/s under call costs measured on this machine. The heads file
feeds `paradecode-export MODEL --heads FILE`, which refuses heads trained for another model and
writes the chosen thresholds into the export's manifest.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from paradecode.graphs.errors import run_command

logger = logging.getLogger("paradecode.train_heads")


def build_parser() -> argparse.ArgumentParser:
    from paradecode.export.cli import MODEL_HELP, layer_list
    from paradecode.export.heads.pipeline import COSTS, HeadsConfig
    from paradecode.export.prompt_sets import NAMES_HELP
    from paradecode.graphs.arguments import positive_int, seed

    def default(name: str) -> str:
        return f"default {HeadsConfig.default(name)}"

    parser = argparse.ArgumentParser(prog="paradecode-train-heads", description=__doc__.splitlines()[0])
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the heads file to write")
    parser.add_argument(
        "--exit-layers", type=layer_list, metavar="E1,E2,...", help="candidate exit layers (default L/4, L/2, 3L/4)"
    )
    data = parser.add_mutually_exclusive_group()
    data.add_argument(
        "--prompts",
        metavar="FILE|NAME",
        help='one prompt per line (\\n for a newline), or a .jsonl file of {"prompt": ...} or {"messages": [...]} '
        f"lines (a chat, rendered with the model's chat template), {NAMES_HELP}: heads is the training set; the "
        "model continues each greedily (default: a built-in set of code and prose prompts)",
    )
    data.add_argument("--text", type=Path, metavar="FILE", help="train on this text instead of generations")
    parser.add_argument(
        "--max-prompts",
        type=positive_int,
        help=f"use a seeded sample of this many prompts when there are more ({default('max_prompts')})",
    )
    parser.add_argument("--new-tokens", type=positive_int, help=f"greedy tokens per prompt ({default('new_tokens')})")
    parser.add_argument(
        "--generation-batch", type=positive_int, help=f"prompts generated at once ({default('generation_batch')})"
    )
    parser.add_argument("--window", type=positive_int, help=f"tokens per --text window ({default('window')})")
    parser.add_argument("--steps", type=positive_int, help=f"distillation steps, at least 1 ({default('steps')})")
    parser.add_argument("--lr", type=float, help=f"Adam learning rate ({default('lr')})")
    parser.add_argument("--batch", type=positive_int, help=f"positions per step ({default('batch')})")
    parser.add_argument("--held-out", type=float, help=f"share of sequences held out ({default('held_out')})")
    parser.add_argument(
        "--head-budget",
        type=float,
        metavar="LAYERS",
        help="the most decoder layers' worth of parameters an exit head may read; sets the reduced "
        f"vocabulary's size ({default('head_budget')})",
    )
    parser.add_argument(
        "--costs",
        metavar="|".join((*COSTS, "FOLDER")),
        help="call costs for the speed calibration: measured (graphs traced from the model, float32, timed here "
        "with onnxruntime), parameters (estimated from parameter counts), or an export of this model with exit "
        "heads (its own graphs timed here: calibrate on the quantized export you will decode with) "
        f"({default('costs')})",
    )
    parser.add_argument(
        "--seed",
        type=seed,
        help="for the held-out split and the training batches, -2**63 to 2**64 - 1 as paradecode-generate takes it (a "
        f"negative one wraps to 2**64 + seed) ({default('seed')})",
    )
    parser.add_argument("--force", action="store_true", default=None, help="replace FILE if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch loads OpenMP: threads that spin while waiting for a descheduled peer make every
    # operation wait on a busy CPU; measured on 2 shared cores, generating 384 tokens took 206 s
    # spinning and 33 s passive. A value the user set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, result = run_command("paradecode-train-heads", lambda: run(args), "interrupted; nothing was written")
    if code == 0:
        print(f"wrote {args.output}: heads after layers {','.join(map(str, sorted(result.transforms)))}")
    return code


def run(args: argparse.Namespace):
    from paradecode.export.cli import quiet_dependency_logs
    from paradecode.export.heads.pipeline import HeadsConfig, train_exit_heads

    quiet_dependency_logs()
    given = {k: v for k, v in vars(args).items() if v is not None}
    result = train_exit_heads(HeadsConfig(**given))
    report(result.metadata)
    return result


def report(metadata: dict) -> None:
    data, vocab, calibration = metadata["data"], metadata["vocab"], metadata["calibration"]
    logger.info(
        "data: %d positions from %d %s (%d held out), recorded in %.0f s",
        data["positions"],
        data.get("sequences", data.get("windows", 0)),
        "continuations" if data["kind"] == "generations" else "text windows",
        data["held_out_positions"],
        data["seconds"],
    )
    logger.info(
        "reduced vocabulary: %d tokens (%.1f%% of held-out final tokens); a head reads %.2f layers' parameters "
        "(the final head %.2f)",
        vocab["size"],
        100 * vocab["held_out_coverage"],
        vocab["head_layers_by_parameters"],
        vocab["final_head_layers_by_parameters"],
    )
    cost = calibration["cost_model"]
    costs = calibration.get("call_costs")
    if costs is not None:
        logger.info(
            "measured per call (%s, median of %d): layer %s ms at T = %s; exit head %.3f ms; final head %s ms; "
            "embedding %.3f ms",
            costs["backend"],
            costs["rounds"],
            " / ".join(f"{v:.3f}" for v in costs["layer_ms"].values()),
            " / ".join(costs["layer_ms"]),
            costs["exit_head_ms"],
            " / ".join(f"{v:.3f}" for v in costs["final_head_ms"].values()),
            costs["embed_ms"],
        )
    logger.info(
        "cost model (%s, in layer calls): exit head %.2f, final head %.2f, merge %.3f per position per layer, "
        "final merge %.3f, rollback %.1f; plain decoding %.2f per token",
        cost["source"],
        cost["head"],
        cost["final"],
        cost["merge"],
        cost["final_merge"],
        cost["lost"],
        cost["ar"],
    )
    logger.info("top-1 agreement with the final layer on held-out positions, and the speed calibration:")
    logger.info(
        "  %-6s %-10s %-8s %-10s %-8s %-10s %-9s %s", "layer", "untrained", "trained", "threshold", "exits",
        "precision", "cascade", "alone",
    )  # fmt: skip
    for e, row in metadata["agreement"].items():
        c = calibration["layers"][e]
        alone = c["alone"]
        logger.info(
            "  %-6s %-10.3f %-8.3f %-10s %-8.3f %-10s %-9.3f %s",
            e,
            row["untrained"],
            row["trained"],
            f"{c['threshold']:.2f}" if c["threshold"] is not None else "never",
            c["exit_rate"],
            f"{c['precision']:.3f}" if c["precision"] is not None else "-",
            c["cascade_exit_rate"],
            f"{alone['speedup']:.3f}x at {alone['thresholds'][0]:.2f}" if alone else "-",
        )
    best = ", ".join(f"{s['layers']} at {s['thresholds']}: {s['speedup']:.3f}x" for s in calibration["subsets"][:4])
    logger.info("expected speedup of the best sets searched (before refining): %s", best or "none")
    check = calibration["check"]
    if calibration["selected_layers"]:
        logger.info(
            "chosen: exit layers %s with thresholds %s: %.1f%% of tokens exit early, %.1f%% exit and are accepted; "
            "expected speedup %.3fx on the %d positions that chose it, %.3fx on %d %s positions%s",
            calibration["selected_layers"],
            [calibration["thresholds"][str(e)] for e in calibration["selected_layers"]],
            100 * calibration["expected_exits"]["exit_rate"],
            100 * calibration["expected_exits"]["accepted_rate"],
            calibration["expected_speedup"],
            calibration["positions"],
            check["expected_speedup"],
            check["positions"],
            "of the same (only one held-out sequence)" if check["in_sample"] else "other held-out",
            ""
            if "expected_tokens_per_s" not in calibration
            else " (about {ar} -> {paradecode} tokens/s by the measured costs)".format(
                **calibration["expected_tokens_per_s"]
            ),
        )
    else:
        logger.info(
            "chosen: no exit layer: no choice is expected to beat plain decoding (best found: %s at %s, %.3fx), "
            "so no layer gets a threshold and the export will never exit by default",
            calibration["best_found"]["layers"],
            calibration["best_found"]["thresholds"],
            calibration["best_found"]["speedup"],
        )


if __name__ == "__main__":
    sys.exit(main())
