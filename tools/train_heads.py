"""`paradecode-train-heads MODEL -o FILE`: train exit heads by distillation and calibrate thresholds.

The heads file feeds `paradecode-export MODEL --heads FILE`, which refuses heads trained for
another model and writes the calibrated thresholds into the export's manifest.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from paradecode.graphs.errors import UserInputError, run_command

logger = logging.getLogger("paradecode.train_heads")


def build_parser() -> argparse.ArgumentParser:
    from paradecode.export.cli import layer_list, positive_int

    parser = argparse.ArgumentParser(prog="paradecode-train-heads", description=__doc__.splitlines()[0])
    parser.add_argument("model", metavar="MODEL", help="a Hugging Face Hub id or a local folder")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the heads file to write")
    parser.add_argument("--exit-layers", type=layer_list, metavar="E1,E2,...", help="default: L/4, L/2, 3L/4")
    data = parser.add_mutually_exclusive_group()
    data.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help='one prompt per line (\\n for a newline), or a .jsonl file of {"prompt": ...} or {"messages": [...]} '
        "lines (a chat, rendered with the model's chat template); the model continues each greedily (default: a "
        "built-in set of code and prose prompts)",
    )
    data.add_argument("--text", type=Path, metavar="FILE", help="train on this text instead of generations")
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="greedy tokens per prompt (default 128)")
    parser.add_argument("--window", type=positive_int, default=256, help="tokens per --text window (default 256)")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps (default 300)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2)")
    parser.add_argument("--batch", type=positive_int, default=1024, help="positions per step (default 1024)")
    parser.add_argument("--held-out", type=float, default=0.2, help="share of sequences held out (default 0.2)")
    parser.add_argument(
        "--target-agreement",
        type=float,
        default=0.95,
        help="calibrate each threshold so early tokens agree with the final ones at least this often (default 0.95)",
    )
    parser.add_argument(
        "--head-cost",
        type=float,
        metavar="C",
        help="cost of one head call in decoder layers, for choosing which exit layers to use "
        "(default: estimated from parameter counts)",
    )
    parser.add_argument(
        "--use-all-exits",
        action="store_true",
        help="give every calibrated exit layer a threshold instead of the cost-model selection",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace FILE if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, result = run_command("paradecode-train-heads", lambda: run(args), "interrupted; nothing was written")
    if code == 0:
        print(f"wrote {args.output}: heads after layers {','.join(map(str, sorted(result.transforms)))}")
    return code


def run(args: argparse.Namespace):
    import torch
    from transformers.utils import logging as hf_logging

    from paradecode.export.config import default_exit_layers
    from paradecode.export.families import family_for
    from paradecode.export.heads import save_heads
    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.source import resolve_model
    from paradecode.tools.heads.calibration import calibrate
    from paradecode.tools.heads.cost import CostModel
    from paradecode.tools.heads.data import DEFAULT_PROMPTS, collect, greedy_sequences, split_held_out
    from paradecode.tools.heads.training import HeadsTraining, Unembedding, evaluate_heads, train_heads
    from paradecode.tools.prompts import read_prompts

    hf_logging.disable_progress_bar()
    if args.output.exists() and not args.force:
        raise UserInputError(f"{args.output} exists. Pass --force to replace it.")
    if not 0 < args.held_out < 1:
        raise UserInputError(f"--held-out must be a share in (0, 1), got {args.held_out}.")
    if not 0 < args.target_agreement <= 1:
        raise UserInputError(f"--target-agreement must be in (0, 1], got {args.target_agreement}.")
    source = resolve_model(args.model)
    family = family_for(source.config_dict().get("model_type"))
    model = load_hf_model(source)
    spec = family.spec(model.config, model)
    exit_layers = tuple(sorted(args.exit_layers)) if args.exit_layers else default_exit_layers(spec.num_layers)
    bad = [e for e in exit_layers if not 1 <= e < spec.num_layers]
    if bad:
        raise UserInputError(f"exit layers {bad} are out of range: choose layers within 1..{spec.num_layers - 1}.")
    cost = None
    if not args.use_all_exits:
        cost = CostModel.estimate(spec) if args.head_cost is None else CostModel(spec.num_layers, args.head_cost)
    tokenizer = load_tokenizer(source.path)
    generator = torch.Generator().manual_seed(args.seed)

    if args.text is not None:
        if tokenizer is None:
            raise UserInputError(f"{args.model} has no tokenizer to read --text with.")
        ids = tokenizer(read_text(args.text))["input_ids"]
        sequences = [ids[i : i + args.window] for i in range(0, len(ids) - 1, args.window)]
        sequences = [s for s in sequences if len(s) > 1]
        data = {"kind": "text", "file": str(args.text), "windows": len(sequences)}
    else:
        if args.prompts is not None:
            if tokenizer is None:
                raise UserInputError(f"{args.model} has no tokenizer to read --prompts with.")
            texts = read_prompts(args.prompts)
        else:
            texts = list(DEFAULT_PROMPTS)
        if tokenizer is not None:
            prompts = prompt_ids_of(tokenizer, texts, args.model)
        else:  # a model without a tokenizer: random short prompts
            prompts = [torch.randint(0, spec.vocab_size, (4,), generator=generator).tolist() for _ in texts]
        logger.info("generating %d greedy continuations of %d tokens", len(prompts), args.new_tokens)
        sequences = greedy_sequences(model, prompts, args.new_tokens)
        data = {
            "kind": "generations",
            "prompts": str(args.prompts) if args.prompts else "built-in",
            "sequences": len(sequences),
            "new_tokens": args.new_tokens,
        }
    if len(sequences) < 2:
        raise UserInputError("need at least two sequences (one to train on, one held out); give more prompts or text.")
    features = collect(model, sequences, exit_layers)
    held_out = split_held_out(features, args.held_out, args.seed)
    data.update(positions=len(held_out), held_out_positions=int(held_out.sum()))
    logger.info(
        "%d positions (%d held out); training heads after layers %s for %d steps",
        data["positions"],
        data["held_out_positions"],
        ",".join(map(str, exit_layers)),
        args.steps,
    )

    unembedding = Unembedding.of(model, family)
    before = evaluate_heads(unembedding, features, held_out, dict.fromkeys(exit_layers))
    transforms, history = train_heads(
        unembedding, features, held_out, steps=args.steps, lr=args.lr, batch=args.batch, seed=args.seed
    )
    after = evaluate_heads(unembedding, features, held_out, transforms)
    table = {
        e: {
            "untrained": round(float(before[1][e].float().mean()), 4),
            "trained": round(float(after[1][e].float().mean()), 4),
        }
        for e in exit_layers
    }
    calibration = calibrate(after[0], after[1], args.target_agreement, cost)
    result = HeadsTraining(transforms, table, calibration, data, history)
    metadata = {
        "base_model": source.hub_id or str(source.path.resolve()),
        "base_weights_sha256": source.identity()["weights_sha256"],
        "data": data,
        "training": {
            "steps": args.steps,
            "lr": args.lr,
            "batch": args.batch,
            "seed": args.seed,
            "final_loss": history[-1].get("loss"),
        },
        "agreement": {str(e): v for e, v in table.items()},
        "calibration": calibration,
    }
    save_heads(args.output, transforms, metadata)
    report(table, calibration)
    return result


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def prompt_ids_of(tokenizer, prompts: list, model: str) -> list[list[int]]:
    """Every prompt's token ids: a text with the tokenizer's special tokens, a chat (a list of messages)
    rendered with the tokenizer's chat template and encoded as it is (as `apply_chat_template` does)."""
    import jinja2

    ids = []
    for number, prompt in enumerate(prompts, 1):
        if isinstance(prompt, str):
            ids.append(tokenizer(prompt)["input_ids"])
            continue
        where = f"prompt {number} (of {len(prompts)})"
        if tokenizer.chat_template is None:
            raise UserInputError(
                f"{where} is a chat, but the tokenizer of {model} has no chat template: give its text as "
                '{"prompt": "..."} instead.'
            )
        try:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as err:
            raise UserInputError(f"{where}: the chat template of {model} refused its messages: {err}") from err
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def read_text(path: Path) -> str:
    if not path.is_file():
        raise UserInputError(f"--text {path}: no such file.")
    return path.read_text()


def report(table: dict, calibration: dict) -> None:
    logger.info(
        "top-1 agreement with the final layer on held-out positions, and calibrated thresholds "
        "(target agreement %.2f):",
        calibration["target_agreement"],
    )
    logger.info(
        "  %-6s %-10s %-8s %-10s %-10s %-9s %-9s %s",
        "layer",
        "untrained",
        "trained",
        "threshold",
        "precision",
        "exits",
        "cascade",
        "used",
    )
    for e, row in table.items():
        c = calibration["layers"][str(e)]
        threshold = f"{c['threshold']:.3f}" if c["threshold"] is not None else "never"
        precision = f"{c['precision']:.3f}" if c["precision"] is not None else "-"
        logger.info(
            "  %-6s %-10.3f %-8.3f %-10s %-10s %-9.3f %-9.3f %s",
            e,
            row["untrained"],
            row["trained"],
            threshold,
            precision,
            c["exit_rate"],
            c["cascade_exit_rate"],
            "yes" if c["selected"] else "no",
        )
    if calibration["cost_model"] is not None:
        best = ", ".join(f"{s['layers']}: {s['speedup']:.2f}x" for s in calibration["subsets"][:4])
        logger.info(
            "cost model (layer units: head %.2f, merge %.2f): expected speedup of the best exit-layer sets "
            "searched: %s",
            calibration["cost_model"]["head"],
            calibration["cost_model"]["merge"],
            best,
        )
        logger.info("using exit layers %s", calibration["selected_layers"] or "none (no set is expected to help)")


if __name__ == "__main__":
    sys.exit(main())
