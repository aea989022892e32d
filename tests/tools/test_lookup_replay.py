"""Lookup replay (tools/lab/lookup_replay.py): exact acceptance on recorded outputs, the cost model's time,
trees of candidates, and the command end to end on stories260K."""

from __future__ import annotations

import json
import math
import random

import pytest

from paradecode.runtime.lookup import LookupConfig, SuffixIndex
from tests.tools.lab import lab_script

lookup_replay = lab_script("lookup_replay")
Costs, replay = lookup_replay.Costs, lookup_replay.replay

pytestmark = pytest.mark.timeout(300)


def test_a_tree_holds_the_proposers_chain_and_its_other_branches():
    rng = random.Random(1)
    for config in (LookupConfig(), LookupConfig(min_ngram=1, length_factor=math.inf)):
        for _ in range(30):
            tokens = [rng.randrange(3) for _ in range(rng.randrange(4, 80))]
            index = SuffixIndex(config)
            index.extend(tokens, len(tokens))
            chain = index.propose(tokens, len(tokens), 5)
            tree = index.branches(tokens, len(tokens), 5, 3)
            assert index.branches(tokens, len(tokens), 5, 1) == ([chain] if chain else [])
            assert (tree[0] if tree else []) == chain  # the most agreed branch first
            assert len({tuple(b) for b in tree}) == len(tree) and all(len(b) <= 5 for b in tree)


def test_replay_counts_what_the_output_accepts_and_what_the_steps_cost():
    # the output repeats the prompt: after the prefill's token 7, "6 7" matched 3 long (5 6 7) proposes 8 9 5 6,
    # the 4 tokens the output has left (the scheduler proposes none past the last needed position)
    prompt, output = [5, 6, 7, 8, 9, 5, 6], [7, 8, 9, 5, 6, 7]
    costs = Costs(pass_s=1.0, position_s=0.1)
    whole = replay(prompt, output, LookupConfig(length_factor=math.inf), 1, costs, max_unverified=5)
    assert (whole.proposed, whole.accepted) == (4, 4)
    assert whole.ratio == pytest.approx(6 / (2 + 0.4))  # the prefill, then one step of 4 proposed positions
    bounded = replay(prompt, output, LookupConfig(length_factor=math.inf), 1, costs, max_unverified=2)
    assert (bounded.proposed, bounded.accepted) == (3, 3)  # K = 2: 8 9, then the one token left to propose: 6
    capped = replay(
        prompt, output, LookupConfig(length_factor=1.0), 1, costs, max_unverified=5
    )  # at most 3 (the match) at once
    assert (capped.proposed, capped.accepted) == (3, 3)
    assert capped.ratio == pytest.approx(6 / (3 + 0.3))  # then one more step for the last token


def test_a_tree_accepts_the_branch_the_output_follows_and_pays_for_every_node():
    # "9 1 2" was followed by 3 twice and by 4 once; the output takes the rarer branch
    prompt = [9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1]
    output = [2, 4, 9, 7]
    tokens = [*prompt, *output]
    index = SuffixIndex(LookupConfig(max_tokens=2, length_factor=math.inf))
    index.extend(tokens, 15)
    assert index.branches(tokens, 15, 2, 1) == [[3, 9]]
    assert index.branches(tokens, 15, 2, 2) == [[3, 9], [4, 9]]
    costs = Costs(pass_s=1.0, position_s=0.1)
    chain = replay(prompt, output, index.config, 1, costs, max_unverified=5)  # 3 9 (wrong), then after 4: 9 (right)
    tree = replay(
        prompt, output, index.config, 2, costs, max_unverified=5
    )  # 3 9 and 4 9 (4 nodes): 4 9 right, the output's end
    assert (chain.proposed, chain.accepted) == (3, 1) and chain.ratio == pytest.approx(4 / (3 + 0.3))
    assert (tree.proposed, tree.accepted) == (4, 2) and tree.ratio == pytest.approx(4 / (2 + 0.4))


def test_the_command_records_then_replays(stories_export, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    lines = [("Once upon a time", "story"), ("The dog ran to the dog", "story"), ("Tim and Tim", "names")]
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in lines))
    outputs, report = tmp_path / "outputs.jsonl", tmp_path / "rows.json"
    args = [str(stories_export[0]), "--outputs", str(outputs), "--prompts", str(prompts), "--max-new-tokens", "24"]
    assert lookup_replay.main([*args, "--ngram", "3,16", "--width", "1,2", "--json", str(report)]) == 0
    table = capsys.readouterr().out
    records = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert [r["category"] for r in records] == ["story", "story", "names"]
    assert all(0 < len(r["output"]) <= 24 for r in records)
    rows = json.loads(report.read_text())["rows"]
    assert [r["setting"] for r in rows] == [
        "match 2-3, x1, 5 tokens",
        "match 2-3, x1, 5 tokens, tree width 2",
        "match 2-16, x1, 5 tokens",
        "match 2-16, x1, 5 tokens, tree width 2",
    ]
    assert all(r["setting"] in table for r in rows) and all(set(r["categories"]) == {"story", "names"} for r in rows)
    # read back, not decoded again (the file is what is replayed: a changed output changes the figures)
    assert lookup_replay.main([*args, "--max-new-tokens", "8", "--position-share", "0"]) == 0
    assert "plus 0.00 ms per proposed position" in capsys.readouterr().out
    assert outputs.read_text().count("\n") == 3
    # outputs recorded shorter than asked for, or for other prompts, are refused, not replayed short or misnamed
    assert lookup_replay.main([*args[:-2], "--max-new-tokens", "30"]) == 2
    assert "fewer than --max-new-tokens 30" in capsys.readouterr().err
    assert lookup_replay.main([*args, "--per-category", "1"]) == 2
    assert "give the same --prompts" in capsys.readouterr().err


def test_the_command_refuses_bad_input(stories_export, tmp_path, capsys):
    outputs = tmp_path / "outputs.jsonl"
    args = [str(stories_export[0]), "--outputs", str(outputs)]
    selection = {"prompts": "heads", "per_category": None, "max_prompts": 100}
    bad = (
        '{"prompt": [1]}',
        '{"category": null, "prompt": [1], "output": ["a"]}',
        '{"category": [1], "prompt": [1], "output": [2]}',
    )
    for line in (*bad, "not json"):
        outputs.write_text(line + "\n")
        assert lookup_replay.main(args) == 2
        assert "delete the file to record it again" in capsys.readouterr().err
    record = {"category": None, "prompt": [1], "output": [2, 3], "selection": selection, "max_new_tokens": 128}
    outputs.write_text(json.dumps(record) + "\n")
    assert lookup_replay.main([*args, "--ngram", "1"]) == 2  # below --min-ngram (2): refused, not lowered
    assert "min_ngram" in capsys.readouterr().err
    for option, value in (("--position-share", "2"), ("--ngram", "0"), ("--width", "a")):
        with pytest.raises(SystemExit):
            lookup_replay.main([*args, option, value])
        assert option in capsys.readouterr().err
