"""Replay lookup proposals on recorded greedy outputs: what a lookup setting, or a tree of proposals, would
accept and cost, without decoding again.

With greedy decoding every ParaDecode output is plain decoding's, so which proposed tokens the final layer
accepts depends only on that output: a recorded output replays any proposer's acceptance exactly. Time comes
from the cost model instead of a clock (and only lookup is replayed: exit heads need the model): a decoding
step costs a token's pass, `pass_s`, plus `position_s` for each proposed position it carries, and emits the
accepted proposals and one token more. The ratio to plain decoding is the output's tokens x `pass_s` over
the replay's total. That is a bound of the kind `paradecode-bench` prints (its scheduler overhead, exits and
the adaptive cut are left out), and the way to compare proposers on many prompts in seconds.

A *tree* replays what verifying several candidates in one call would give (the design in docs/export.md, *The next
layer contract*; not built): at each depth the `width` continuations the longest match's occurrences agree
on most, each branch followed on; the step costs one position per distinct node and accepts the longest
branch the output follows.

    python tools/lab/lookup_replay.py out/smollm2-int8 --prompts heads --max-prompts 100 \\
        --outputs heads-outputs.jsonl --ngram 3,16 --length-factor inf,1 --width 1,2

records plain decoding's outputs into `--outputs` (or reads them where the file exists: it records which
prompts it holds, and a file of other prompts is refused), measures the
export's call costs (a layer graph at 1 and at K + 1 positions, the final head likewise), and prints one row
per setting: the mean ratio over prompts, the median over categories, the lowest category, and tokens
proposed and accepted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from paradecode.graphs.errors import UserInputError, run_command

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Costs:
    """Seconds: a decoding step's pass at one position, and what each further position adds to it."""

    pass_s: float
    position_s: float


@dataclass
class Replayed:
    """One output replayed: its ratio to plain decoding, and the tokens proposed and accepted."""

    ratio: float
    proposed: int
    accepted: int


def replay(prompt: list[int], output: list[int], config, width: int, costs: Costs, *, max_unverified: int) -> Replayed:
    """Decode `output` again with lookup alone (see the module's docstring); `max_unverified` is the scheduler's
    K, which bounds a proposal as `max_tokens` does."""
    from paradecode.runtime.lookup import SuffixIndex

    tokens = [*prompt, *output]
    index = SuffixIndex(config)
    end = len(prompt) + 1  # the prefill gave the first output token
    spent, proposed, accepted = costs.pass_s, 0, 0
    while end < len(tokens):
        index.extend(tokens, end)  # everything before `end` is verified, as the scheduler indexes it first
        # as the scheduler's room: no more than max_tokens and K, none past the output's last token
        room = min(config.max_tokens, max_unverified, len(tokens) - end - 1)
        branches = index.branches(tokens, end, room, width)
        nodes = {tuple(b[:d]) for b in branches for d in range(1, len(b) + 1)}
        best = max((_followed(b, tokens, end) for b in branches), default=0)
        spent += costs.pass_s + len(nodes) * costs.position_s
        proposed, accepted = proposed + len(nodes), accepted + best
        end += best + 1
    return Replayed(len(output) * costs.pass_s / spent, proposed, accepted)


def _followed(branch: list[int], tokens: Sequence[int], end: int) -> int:
    """How many of a branch's tokens the output continues with."""
    count = 0
    while count < len(branch) and end + count < len(tokens) and branch[count] == tokens[end + count]:
        count += 1
    return count


def summary(name: str, replayed: list[tuple[str, Replayed]]) -> dict:
    by_category = defaultdict(list)
    for category, r in replayed:
        by_category[category].append(r.ratio)
    means = {c: statistics.fmean(v) for c, v in sorted(by_category.items(), key=lambda item: str(item[0]))}
    return {
        "setting": name,
        "mean": statistics.fmean(r.ratio for _, r in replayed),
        "median_over_categories": statistics.median(means.values()),
        "lowest_category": min(means.values()),
        "proposed": sum(r.proposed for _, r in replayed),
        "accepted": sum(r.accepted for _, r in replayed),
        "categories": means,
    }


def markdown(rows: list[dict], costs: Costs, prompts: int, new_tokens: int) -> str:
    categories = list(rows[0]["categories"])
    lines = [
        f"{prompts} outputs of up to {new_tokens} tokens; a step costs {costs.pass_s * 1e3:.2f} ms plus "
        f"{costs.position_s * 1e3:.2f} ms per proposed position; ratios to plain decoding by the cost model",
        "",
        "| setting | mean | median over categories | lowest category | proposed | accepted | "
        + " | ".join(categories)
        + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in categories) + " |",
    ]
    for r in rows:
        share = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        cells = " | ".join(f"{r['categories'][c]:.2f}x" for c in categories)
        lines.append(
            f"| {r['setting']} | {r['mean']:.3f}x | {r['median_over_categories']:.3f}x | {r['lowest_category']:.3f}x "
            f"| {r['proposed']} | {r['accepted']} ({share:.0%}) | {cells} |"
        )
    return "\n".join(lines)


def selection_of(args) -> dict:
    """Which prompts the outputs are for, as recorded with each: a file of other prompts is refused, not replayed."""
    return {"prompts": str(args.prompts), "per_category": args.per_category, "max_prompts": args.max_prompts}


def recorded_length(path: Path, record: dict, max_new_tokens: int) -> None:
    """Refuse outputs recorded shorter than asked for (they would be replayed short without a word)."""
    recorded = record.get("max_new_tokens")
    if not isinstance(recorded, int) or recorded < max_new_tokens:
        raise UserInputError(
            f"{path} holds outputs of up to {recorded} new tokens, fewer than --max-new-tokens {max_new_tokens}: ask "
            "for at most that many, or record them again into another --outputs file."
        )


def read_outputs(path: Path, selection: dict, max_new_tokens: int) -> list[dict]:
    """Recorded outputs (the first `max_new_tokens` of each), checked: each line as this tool writes it, for the
    prompts `selection` names."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserInputError(
                f"{path}:{number} is not JSON ({err.msg}): delete the file to record it again."
            ) from None
        category = record.get("category") if isinstance(record, dict) else None
        fields_ok = isinstance(record, dict) and _token_ids(record.get("prompt")) and _token_ids(record.get("output"))
        if not fields_ok or not (category is None or isinstance(category, str)):
            raise UserInputError(
                f"{path}:{number}: expected {{category, prompt, output, selection}} with token id lists, as this tool "
                "writes them: delete the file to record it again."
            )
        recorded_length(path, record, max_new_tokens)
        if record.get("selection") != selection:
            raise UserInputError(
                f"{path} holds outputs for the prompts {record.get('selection')}, not {selection}: give the same "
                "--prompts, --per-category and --max-prompts, or another --outputs file."
            )
        if record["output"]:
            records.append({**record, "output": record["output"][:max_new_tokens]})
    logger.info("read %d recorded outputs from %s", len(records), path)
    return records


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def recorded_outputs(args) -> list[dict]:
    """Plain decoding's outputs for the prompts: read from `--outputs` where it exists, else decoded and saved."""
    path, selection = Path(args.outputs), selection_of(args)
    if path.exists():
        return read_outputs(path, selection, args.max_new_tokens)
    from tqdm import tqdm

    from paradecode.export.prompt_sets import load_prompts
    from paradecode.runtime import load
    from paradecode.tools.bench import first_of_each_category

    prompts = load_prompts(args.prompts)
    if args.per_category is not None:  # as paradecode-bench picks them, so the two can be compared
        prompts = first_of_each_category(prompts, args.per_category)
    prompts = prompts[: args.max_prompts]
    logger.info("recording plain decoding's outputs for %d prompts of %s", len(prompts), args.prompts)
    records = []
    with load(args.export) as model:
        for labelled in tqdm(prompts, desc="plain decoding", unit="prompt"):
            given = labelled.prompt
            ids = model.prompt_ids(messages=given) if isinstance(given, list) else model.prompt_ids(prompt=given)
            result = model.generate(prompt_ids=ids, mode="ar", max_new_tokens=args.max_new_tokens)
            record = {"category": labelled.category, "prompt": ids, "output": result.token_ids}
            records.append({**record, "selection": selection, "max_new_tokens": args.max_new_tokens})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [r for r in records if r["output"]]


def measured_costs(export: str, positions: int) -> Costs:
    """A pass and a position's cost from the export's measured call costs (layer graphs and the final head)."""
    from paradecode.export.heads.call_costs import measure_call_costs
    from paradecode.runtime import load

    with load(export) as model:
        costs = measure_call_costs(model.backend, model.backend.allocate_cache(), (1, positions))
        layers = model.manifest.spec.num_layers
    one = layers * costs.layer[1] + costs.final_head[1]
    more = layers * costs.layer[positions] + costs.final_head[positions]
    return Costs(one, (more - one) / (positions - 1))


def share(text: str) -> float:
    """A share of a pass, 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1 (a share of a pass), got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1 (a share of a pass), got {value:g}")
    return value


def numbers(option: str, kind: type):
    """An argparse type for comma-separated positive numbers of `kind` (bench's parse_numbers)."""
    from paradecode.tools.bench import parse_numbers

    def parse(text: str) -> list:
        try:
            return parse_numbers(text, option, kind)
        except UserInputError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


PROG = "python tools/lab/lookup_replay.py"


def build_parser() -> argparse.ArgumentParser:
    from paradecode.graphs.arguments import positive_int
    from paradecode.runtime.config import GenerationConfig

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="an export folder (its outputs are recorded and its calls timed)")
    parser.add_argument(
        "--outputs",
        required=True,
        help="plain decoding's outputs, JSON lines: read (the first --max-new-tokens of each) or written",
    )
    parser.add_argument("--prompts", default="heads", help="prompts to record outputs for (default heads)")
    parser.add_argument("--per-category", type=positive_int, metavar="N", help="the first N prompts of each category")
    parser.add_argument("--max-prompts", type=positive_int, default=100, metavar="N", help="at most N (default 100)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    parser.add_argument("--tokens", type=positive_int, default=GenerationConfig.lookup_tokens, metavar="N")
    parser.add_argument("--ngram", type=numbers("--ngram", int), default=[16], metavar="N1,N2")
    parser.add_argument("--min-ngram", type=positive_int, default=GenerationConfig.lookup_min_ngram, metavar="N")
    parser.add_argument("--length-factor", type=numbers("--length-factor", float), default=[1.0], metavar="F1,F2")
    parser.add_argument("--width", type=numbers("--width", int), default=[1], metavar="W1,W2")
    parser.add_argument("--max-unverified", type=positive_int, default=GenerationConfig.max_unverified, metavar="K")
    parser.add_argument(
        "--position-share",
        type=share,
        metavar="S",
        help="replay as if a proposed position cost S x a pass instead of what it measures here (a what-if for "
        "another device: on a GPU a decoding step's extra positions are nearly free)",
    )
    parser.add_argument("--json", help="also write the rows here")
    return parser


def run(args) -> str:
    from paradecode.runtime.lookup import LookupConfig

    settings = [
        (LookupConfig(max_ngram=n, min_ngram=args.min_ngram, max_tokens=args.tokens, length_factor=f), w)
        for n, f, w in itertools.product(args.ngram, args.length_factor, args.width)
    ]
    records = recorded_outputs(args)
    if not records:
        raise UserInputError(f"{args.outputs} holds no outputs: delete it to record them again.")
    costs = measured_costs(args.export, args.tokens + 1)
    if args.position_share is not None:
        costs = Costs(costs.pass_s, args.position_share * costs.pass_s)
    rows = []
    for config, width in settings:
        name = f"match {config.min_ngram}-{config.max_ngram}, x{config.length_factor:g}, {args.tokens} tokens"
        name += f", tree width {width}" if width > 1 else ""
        replayed = [
            (r["category"], replay(r["prompt"], r["output"], config, width, costs, max_unverified=args.max_unverified))
            for r in records
        ]
        rows.append(summary(name, replayed))
    if args.json:
        Path(args.json).write_text(json.dumps({"costs_s": asdict(costs), "rows": rows}, indent=1))
    return markdown(rows, costs, len(records), max(len(r["output"]) for r in records))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, table = run_command(PROG, lambda: run(args), "interrupted")
    if code == 0:
        print(table)
    return code


if __name__ == "__main__":
    sys.exit(main())
