# stories260K, one thread per call: best and median tokens/s of 30 runs of ar, ParaDecode (batched) and ParaDecode
# (streams). Usage: python best-of-30-overlaps.py EXPORT
import statistics
import sys
import time

from paradecode.runtime import load

m = load(sys.argv[1], threads=1)
prompt = list(range(1, 20))
out = []
for name, settings in (("ar", {"mode": "ar"}), ("paradecode", {}), ("streams", {"overlap": "streams"})):
    for _ in range(2):
        m.generate(prompt_ids=prompt, max_new_tokens=128, ignore_eos=True, **settings)
    seconds = []
    for _ in range(30):
        began = time.perf_counter()
        result = m.generate(prompt_ids=prompt, max_new_tokens=128, ignore_eos=True, **settings)
        seconds.append(time.perf_counter() - began)
    stats = result.stats
    out.append(
        f"{name} best {128 / min(seconds):.0f} median {128 / statistics.median(seconds):.0f} tok/s "
        f"({stats.mode}, {stats.overlap}, ids {hash(tuple(result.token_ids)) % 10**6})"
    )
print("; ".join(out))
