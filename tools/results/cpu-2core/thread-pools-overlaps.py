# ar, and ParaDecode in the streams and both overlaps (exits at the export's thresholds, adaptive off), one chat prompt, 96 tokens,
# 4 repeats, median tokens/s: python tools/results/cpu-2core/thread-pools-overlaps.py EXPORT (thread-pools.md)
import statistics, sys, time
from paradecode.runtime import load
msgs = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
m = load(sys.argv[1])
res = {}
for name, kw in (("ar", {"mode": "ar"}), ("streams", {"overlap": "streams", "adaptive": False}), ("both", {"overlap": "both", "adaptive": False})):
    m.generate(messages=msgs, max_new_tokens=16, **kw)
    ts = []
    for _ in range(4):
        t = time.perf_counter(); out = m.generate(messages=msgs, max_new_tokens=96, ignore_eos=True, **kw); ts.append(time.perf_counter() - t)
    res[name] = 96 / statistics.median(ts)
print(" ".join(f"{k} {v:.1f}" for k, v in res.items()))
