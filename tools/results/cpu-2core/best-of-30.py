# Plain decoding and ParaDecode of stories260K, one thread per call: tokens/s of the fastest of 30 runs and the median.
import statistics
import sys
import time

from paradecode.runtime import load

m = load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/s11/st", threads=1)
prompt = list(range(1, 20))
out = []
for mode in ("ar", "paradecode"):
    m.generate(prompt_ids=prompt, max_new_tokens=128, mode=mode, ignore_eos=True)
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        m.generate(prompt_ids=prompt, max_new_tokens=128, mode=mode, ignore_eos=True)
        ts.append(time.perf_counter() - t)
    out.append(f"{mode} best {128 / min(ts):.0f} median {128 / statistics.median(ts):.0f} tok/s")
print("; ".join(out))
