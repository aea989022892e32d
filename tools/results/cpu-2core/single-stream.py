"""One tree's single-stream figures on an export: eval prompts (first per category), ar and paradecode, 128 tokens."""
import hashlib, json, statistics, sys
from paradecode.runtime import load
from paradecode.export.prompt_sets import load_prompts

export = sys.argv[1]
seen, prompts = set(), []
for p in load_prompts("eval"):
    if p.category not in seen:
        seen.add(p.category); prompts.append(p.prompt)
model = load(export)
rates = {"ar": [], "paradecode": []}
digest = hashlib.sha256()
for prompt in prompts:
    for mode in ("ar", "paradecode"):
        kw = {"messages": prompt} if not isinstance(prompt, str) else {"prompt": prompt}
        r = model.generate(**kw, max_new_tokens=128, mode=mode)
        rates[mode].append(r.stats.tokens_per_second)
        digest.update(json.dumps(list(r.token_ids)).encode())
print(json.dumps({m: statistics.median(v) for m, v in rates.items()} | {"tokens": digest.hexdigest()[:12]}))
