"""Replay lookup proposals on recorded greedy outputs: what a lookup setting, or a tree of proposals, would
accept and cost, without decoding again.

With greedy decoding every ParaDecode output is plain decoding's, so which proposed tokens the final layer
accepts depends only on that output: a recorded output replays any proposer's acceptance exactly. Time comes
from the cost model instead of a clock (and only lookup is replayed: exit heads need the model): a decoding
step costs a token's pass, `pass_s`, plus `position_s` for each proposed position it carries, and emits the
accepted proposals and one token more. The ratio to plain decoding is the output's tokens x `pass_s` over
the replay's total. That is a bound of the kind `paradecode-bench` prints (its scheduler overhead, exits and
the adaptive cut are left out), and the way to compare proposers on many prompts in seconds.

A *tree* replays what verifying several candidates in one call would give (the design in README, *The next
layer contract*; not built): at each depth the `width` continuations the longest match's occurrences agree
on most, each branch followed on; the step costs one position per distinct node and accepts the longest
branch the output follows.

    python -m paradecode.tools.lookup_replay out/smollm2-int8 --prompts heads --max-prompts 100 \\
        --outputs heads-outputs.jsonl --ngram 3,16 --length-factor inf,1 --width 1,2

records plain decoding's outputs into `--outputs` (or reads them where the file exists), measures the
export's call costs (a layer graph at 1 and at K + 1 positions, the final head likewise), and prints one row
per setting: the mean ratio over prompts, the median over categories, the lowest category, and tokens
proposed and accepted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import statistics
import sys
from collections import Counter, defaultdict
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


def candidate_tree(index, tokens: Sequence[int], end: int, count: int, width: int) -> list[list[int]]:
    """The branches of a tree of proposals after tokens[:end]: from the longest match's occurrences, at each
    depth the `width` most agreed continuations (ties to the newest), each followed on with the occurrences
    that continued so. Width 1 is `SuffixIndex.propose`'s chain."""
    longest, alive = index.match(tokens, end)
    if count < 1 or not alive:
        return []
    factor = index.config.length_factor
    if math.isfinite(factor):
        count = min(count, max(1, int(factor * longest)))

    def grow(prefix: list[int], occurrences: list[int]) -> list[list[int]]:
        following = [(tokens[s + len(prefix)], s) for s in occurrences if s + len(prefix) < index.indexed]
        if len(prefix) == count or not following:
            return [prefix] if prefix else []
        votes = Counter(t for t, _ in following)
        newest = dict(following)  # occurrences are oldest first: the last one kept is the newest
        ranked = sorted(votes, key=lambda t: (votes[t], newest[t]), reverse=True)[:width]
        return [b for t in ranked for b in grow([*prefix, t], [s for u, s in following if u == t])]

    return grow([], alive)


def replay(prompt: list[int], output: list[int], config, width: int, costs: Costs) -> Replayed:
    """Decode `output` again with lookup alone (see the module's docstring)."""
    from paradecode.runtime.lookup import SuffixIndex

    tokens = [*prompt, *output]
    index = SuffixIndex(config)
    end = len(prompt) + 1  # the prefill gave the first output token
    spent, proposed, accepted = costs.pass_s, 0, 0
    while end < len(tokens):
        index.extend(tokens, end)
        room = min(config.max_tokens, len(tokens) - end - 1)  # as the scheduler: no proposal past the last token
        branches = candidate_tree(index, tokens, end, room, width)
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
    means = {c: statistics.fmean(v) for c, v in sorted(by_category.items())}
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


def recorded_outputs(args) -> list[dict]:
    """Plain decoding's outputs for the prompts: read from `--outputs` where it exists, else decoded and saved."""
    path = Path(args.outputs)
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not all(isinstance(r, dict) and {"category", "prompt", "output"} <= r.keys() for r in records):
            raise UserInputError(f"{path}: expected lines of {{category, prompt, output}} as this tool writes them.")
        logger.info("read %d recorded outputs from %s", len(records), path)
        return [{**r, "output": r["output"][: args.max_new_tokens]} for r in records]
    from tqdm import tqdm

    from paradecode.runtime import load
    from paradecode.tools.bench import first_of_each_category
    from paradecode.tools.prompt_sets import load_prompts

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
            records.append({"category": labelled.category, "prompt": ids, "output": result.token_ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def measured_costs(export: str, positions: int) -> Costs:
    """A pass and a position's cost from the export's measured call costs (layer graphs and the final head)."""
    from paradecode.runtime import load
    from paradecode.tools.call_costs import measure_call_costs

    with load(export) as model:
        costs = measure_call_costs(model.backend, model.cache, (1, positions))
        layers = model.manifest.spec.num_layers
    one = layers * costs.layer[1] + costs.final_head[1]
    more = layers * costs.layer[positions] + costs.final_head[positions]
    return Costs(one, (more - one) / (positions - 1))


def build_parser() -> argparse.ArgumentParser:
    from paradecode.graphs.arguments import positive_int
    from paradecode.runtime.config import GenerationConfig
    from paradecode.tools.bench import parse_numbers

    prog, about = "python -m paradecode.tools.lookup_replay", __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=prog, description=about)
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
    parser.add_argument("--ngram", type=lambda t: parse_numbers(t, "--ngram", int), default=[16], metavar="N1,N2")
    parser.add_argument("--min-ngram", type=positive_int, default=GenerationConfig.lookup_min_ngram, metavar="N")
    parser.add_argument(
        "--length-factor", type=lambda t: parse_numbers(t, "--length-factor", float), default=[1.0], metavar="F1,F2"
    )
    parser.add_argument("--width", type=lambda t: parse_numbers(t, "--width", int), default=[1], metavar="W1,W2")
    parser.add_argument(
        "--position-share",
        type=float,
        metavar="S",
        help="replay as if a proposed position cost S x a pass instead of what it measures here (a what-if for "
        "another device: on a GPU a decoding step's extra positions are nearly free)",
    )
    parser.add_argument("--json", help="also write the rows here")
    return parser


def run(args) -> str:
    from paradecode.runtime.lookup import LookupConfig

    settings = [
        (LookupConfig(max_ngram=n, min_ngram=min(args.min_ngram, n), max_tokens=args.tokens, length_factor=f), w)
        for n, f, w in itertools.product(args.ngram, args.length_factor, args.width)
    ]
    records = recorded_outputs(args)
    if not records:
        raise UserInputError(f"{args.outputs} holds no outputs: delete it to record them again.")
    costs = measured_costs(args.export, args.tokens + 1)
    if args.position_share is not None:
        if not 0 <= args.position_share <= 1:
            raise UserInputError(f"--position-share must be within 0..1 (of a pass), got {args.position_share:g}.")
        costs = Costs(costs.pass_s, args.position_share * costs.pass_s)
    rows = []
    for config, width in settings:
        name = f"match {config.min_ngram}-{config.max_ngram}, x{config.length_factor:g}, {args.tokens} tokens"
        name += f", tree width {width}" if width > 1 else ""
        replayed = [(r["category"], replay(r["prompt"], r["output"], config, width, costs)) for r in records]
        rows.append(summary(name, replayed))
    if args.json:
        Path(args.json).write_text(json.dumps({"costs_s": asdict(costs), "rows": rows}, indent=1))
    return markdown(rows, costs, len(records), max(len(r["output"]) for r in records))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, table = run_command("paradecode-lookup-replay", lambda: run(args), "interrupted")
    if code == 0:
        print(table)
    return code


if __name__ == "__main__":
    sys.exit(main())
