"""Host work per token: an export decoded with a backend that computes nothing (each call returns the outputs its
first call of that subgraph and shape made), so what is left is the runtime's own Python and the backend's feeds.

    python tools/results/cpu-2core/host-per-token.py EXPORT [TOKENS]

Prints microseconds per token (the fastest of 30 runs, and the median) for ar, ParaDecode without lookup and
ParaDecode with its defaults, one thread per call. The outputs it decodes are meaningless (each call's are its first
call's); the calls are the real ones.
"""

import statistics
import sys
import time

from paradecode.runtime import load

export, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256
model = load(export, threads=1)
backend = model.backend
real, seen = backend._launch, {}


def no_compute(name, feeds, lane):
    key = (name, tuple(next(iter(feeds.values())).shape[:2]))
    if key not in seen:
        outputs, _ = real(name, feeds, lane)
        seen[key] = ({k: v.clone() for k, v in outputs.items()}, False)
    return seen[key]


backend._launch = no_compute
prompt = list(range(1, 20))
for mode, extra in (("ar", {}), ("paradecode", {"lookup_tokens": 0}), ("paradecode", {})):
    settings = dict(prompt_ids=prompt, max_new_tokens=tokens, mode=mode, ignore_eos=True, **extra)
    model.generate(**settings)
    times = []
    for _ in range(30):
        began = time.perf_counter()
        result = model.generate(**settings)
        times.append(time.perf_counter() - began)
    best, median = 1e6 * min(times) / tokens, 1e6 * statistics.median(times) / tokens
    print(f"{mode} {extra or ''}: {best:.1f} us/token (median {median:.1f}), {result.stats.calls} calls")
