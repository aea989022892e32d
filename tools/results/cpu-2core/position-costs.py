"""What a proposed position costs on an export, three ways (tools/results/cpu-2core/position-costs.md).

    python tools/results/cpu-2core/position-costs.py EXPORT calls [THREADS]   # a pass at 1..64 positions, back to back
    python tools/results/cpu-2core/position-costs.py EXPORT ops               # onnxruntime's profile per operator type
    python tools/results/cpu-2core/position-costs.py EXPORT decoding          # inside decoding: every call's time

`calls`: every layer and the final head at T positions (from position 300 of an empty cache), 7 rounds over T =
1, 2, 4, 6, 8, 16, 32, 64, the first round dropped; the median per T and what an extra position adds as a share
of one position's pass. THREADS: onnxruntime threads for every call (default: the backend's own choice).
`ops`: the same pass at 1 and at 6 positions, 60 times each, with onnxruntime's profiler on; milliseconds per pass
by operator type (the first 10 of each dropped). The profiler slows every operator alike, so read the ratios.
`decoding`: one eval prompt per category, twice, 128 new tokens, ar then ParaDecode (the defaults); each call's
time by subgraph and positions, and how much of decoding is outside the calls.
"""

import collections
import glob
import json
import statistics
import sys
import tempfile
import time

import torch

from paradecode.runtime import Tracing, load
from paradecode.runtime.decoding import MAIN, DecodeContext
from paradecode.runtime.tracing import Timeline

START = 300


def one_pass(ctx: DecodeContext, positions: int) -> None:
    hidden = ctx.layers(MAIN, 1, ctx.num_layers, torch.randn(1, positions, ctx.backend.spec.hidden_size), START)
    ctx.head(MAIN, "final", hidden, START)


def calls(path: str, threads: int | None) -> None:
    model = load(path, **({"threads": threads} if threads else {}))
    ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
    widths, times = (1, 2, 4, 6, 8, 16, 32, 64), collections.defaultdict(list)
    for _ in range(7):
        for width in widths:
            began = time.perf_counter()
            one_pass(ctx, width)
            times[width].append(time.perf_counter() - began)
    one = statistics.median(times[1][1:])
    for width in widths:
        kept = times[width][1:]
        share = (statistics.median(kept) - one) / one / (width - 1) if width > 1 else 0.0
        print(
            f"{width:3d} positions: {statistics.median(kept) * 1e3:7.2f} ms (min {min(kept) * 1e3:.2f}, "
            f"max {max(kept) * 1e3:.2f}); an extra position {share:.3f} of a one-position pass"
        )
    print("threads:", model.backend.threads)


def ops(path: str) -> None:
    from paradecode.runtime.backends import onnxruntime_backend

    folder = tempfile.mkdtemp()
    plain = onnxruntime_backend.OnnxRuntimeBackend._options

    def profiled(threads: int):
        options = plain(threads)
        options.enable_profiling = True
        options.profile_file_prefix = f"{folder}/ort"
        return options

    onnxruntime_backend.OnnxRuntimeBackend._options = staticmethod(profiled)
    model = load(path)
    ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
    runs, dropped = 60, 10
    for width in (1, 6):
        for _ in range(runs):
            one_pass(ctx, width)
    for session in model.backend.sessions.values():
        session.end_profiling()
    per_op = {1: collections.Counter(), 6: collections.Counter()}
    for name in glob.glob(f"{folder}/ort*.json"):
        with open(name) as file:
            events = json.load(file)
        passes = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
        half = len(passes) // 2
        for event in events:
            if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
                continue
            index = next((i for i, p in enumerate(passes) if p["ts"] <= event["ts"] <= p["ts"] + p["dur"]), None)
            if index is not None and index % half >= dropped:
                per_op[1 if index < half else 6][event["args"]["op_name"]] += event["dur"]
    kept = runs - dropped
    print(f"{'operator':28s} {'1 position':>11s} {'6 positions':>12s}  (ms per pass, profiled)")
    for op, _ in per_op[6].most_common():
        print(f"{op:28s} {per_op[1][op] / kept / 1e3:11.3f} {per_op[6][op] / kept / 1e3:12.3f}")
    print(f"{'all':28s} {sum(per_op[1].values()) / kept / 1e3:11.3f} {sum(per_op[6].values()) / kept / 1e3:12.3f}")


def decoding(path: str) -> None:
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.tools.bench import first_of_each_category

    model = load(path)
    by_call = {"ar": collections.defaultdict(list), "paradecode": collections.defaultdict(list)}
    totals = {mode: collections.Counter() for mode in by_call}
    for labelled in first_of_each_category(load_prompts("eval"), 1) * 2:
        given = labelled.prompt
        ids = model.prompt_ids(messages=given) if isinstance(given, list) else model.prompt_ids(prompt=given)
        for mode in by_call:
            result = model.generate(prompt_ids=ids, mode=mode, max_new_tokens=128, tracing=Tracing(spans=True))
            spans = sorted(result.timeline.spans, key=lambda s: s.start)
            prefill_end = next(i for i, s in enumerate(spans) if s.name == "final")  # the prefill's head
            decode = spans[prefill_end + 1 :]
            totals[mode]["decode_s"] += decode[-1].end - spans[prefill_end].end
            totals[mode]["inside_calls_s"] += sum(s.end - s.start for s in decode)
            totals[mode]["tokens"] += result.stats.new_tokens - 1
            totals[mode]["steps"] += sum(1 for s in decode if s.name == "final")
            for span in decode:
                by_call[mode][span.name, span.positions[1] - span.positions[0]].append(span.end - span.start)
    for mode, total in totals.items():
        outside = 1 - total["inside_calls_s"] / total["decode_s"]
        rate = total["tokens"] / total["decode_s"]
        print(f"{mode}: {total['tokens']} tokens in {total['steps']} steps, {rate:.1f} tokens/s, {outside:.1%} outside")
        for (name, width), seconds in sorted(by_call[mode].items()):
            if len(seconds) >= 5:
                print(f"    {name} at {width}: {len(seconds)} calls, median {statistics.median(seconds) * 1e3:.3f} ms")


if __name__ == "__main__":
    export, what = sys.argv[1], sys.argv[2]
    if what == "calls":
        calls(export, int(sys.argv[3]) if len(sys.argv) > 3 else None)
    elif what == "ops":
        ops(export)
    else:
        decoding(export)
