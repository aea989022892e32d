# SmolLM2: best and median tokens/s of 8 runs per prompt (three eval chat prompts, 128 tokens), ar and ParaDecode with
# generate's defaults; the mean over prompts. Usage: python best-of-8-smollm2.py EXPORT
import json
import statistics
import sys
import time
from pathlib import Path

from paradecode.runtime import load

m = load(sys.argv[1])
prompts, seen = [], set()
for line in (Path(__file__).resolve().parents[3] / "export/data/eval_chat.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row["category"] in ("code", "writing", "qa_context") and row["category"] not in seen:
        seen.add(row["category"])
        prompts.append(m.prompt_ids(messages=row["messages"]))
out = []
for name, settings in (("ar", {"mode": "ar"}), ("paradecode", {})):
    best, median, ids = [], [], []
    for prompt in prompts:
        m.generate(prompt_ids=prompt, max_new_tokens=128, **settings)
        rates = []
        for _ in range(8):
            began = time.perf_counter()
            result = m.generate(prompt_ids=prompt, max_new_tokens=128, **settings)
            rates.append(result.stats.new_tokens / (time.perf_counter() - began))
        best.append(max(rates))
        median.append(statistics.median(rates))
        ids.append(tuple(result.token_ids))
    digest = hash(tuple(ids)) % 10**6  # the same outputs give the same digest (ints hash alike in every process)
    out.append(f"{name} best {statistics.mean(best):.1f} median {statistics.mean(median):.1f} ({name}, ids {digest})")
print("; ".join(out))
