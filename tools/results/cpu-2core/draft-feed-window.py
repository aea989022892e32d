"""Decoding speed with the draft head's feed bounded (proposers.FEED_WINDOW) against unbounded, interleaved in one
process on the same `eval` prompts, every output checked against plain decoding's (lab; issue 58).

Usage: draft-feed-window.py EXPORT PER_CATEGORY REPEATS DRAFT_TOKENS LOOKUP_TOKENS OUT.json
"""
import json, statistics, sys
from collections import defaultdict
from pathlib import Path
from paradecode.export.prompt_sets import load_prompts
from paradecode.runtime import load, proposers

export, per, repeats = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
draft_tokens, lookup, out_path = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
chosen, seen = [], defaultdict(int)
for p in load_prompts("eval"):
    if seen[p.category] < per:
        seen[p.category] += 1
        chosen.append(p)
windows = {"bounded 64": 64, "unbounded": 10**9}
rates, same, counts = defaultdict(list), True, defaultdict(lambda: [0, 0])
with load(export) as model:
    for prompt in chosen:
        ids = model.prompt_ids(messages=prompt.prompt)
        plain = model.generate(prompt_ids=ids, max_new_tokens=128, mode="ar").token_ids
        for r in range(repeats):
            for name, w in windows.items():
                proposers.FEED_WINDOW = w
                out = model.generate(prompt_ids=ids, max_new_tokens=128, mode="paradecode", draft_tokens=draft_tokens,
                                     lookup_tokens=lookup, adaptive=True)
                same &= out.token_ids == plain
                rates[name, prompt.category].append(out.stats.tokens_per_second)
                rates[name, "all"].append(out.stats.tokens_per_second)
                if r == 0:
                    counts[name, prompt.category][0] += out.stats.draft_proposed
                    counts[name, prompt.category][1] += out.stats.draft_accepted
        print(prompt.category, len(ids), "prompt tokens", flush=True)
table = {f"{n} | {c}": (round(statistics.median(v), 1), round(min(v), 1), round(max(v), 1)) for (n, c), v in rates.items()}
for k in sorted(table):
    print(k, table[k], counts.get(tuple(k.split(" | ")), ""))
print("identical to plain decoding:", same)
json.dump({"rates": table, "counts": {f"{n} | {c}": v for (n, c), v in counts.items()}, "identical": same}, open(out_path, "w"), indent=1)
