"""A/B of the onnxruntime backend's threads for prefills (THREADS in runtime/backends/onnxruntime_backend.py), on
an export with int8 activations. A runs every layer call on one thread (as before); B, the default, runs a layer
graph's calls of more than BOUND_TOKENS positions (a prefill) on every core through a second session. Per prompt,
interleaved (the order alternating): ar and ParaDecode on each, greedy, the CPU defaults (lookup alone). Prints and
writes decoding tokens/s, prefill seconds, and whether the four outputs are the same.

    python tools/results/cpu-2core/prefill-threads.py EXPORT PER_CATEGORY REPEATS OUT.json [--b-first]

--b-first loads B's model before A's (a control for the load order).
"""

import json
import statistics
import sys

from paradecode.export.prompt_sets import load_prompts
from paradecode.runtime import load
from paradecode.tools.bench import first_of_each_category

RUNS = (("A", "ar"), ("A", "paradecode"), ("B", "paradecode"), ("B", "ar"))
RATIOS = (
    ("A_paradecode", "A_ar"),
    ("B_paradecode", "B_ar"),
    ("B_paradecode", "A_paradecode"),
    ("B_ar", "A_ar"),
)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main(path: str, per_category: int, repeats: int, out: str, b_first: bool = False) -> None:
    models = {which: load(path) for which in ("AB" if not b_first else "BA")}  # the load order: a control
    models["A"].backend.threads["prefill"] = models["A"].backend.threads["layers"]  # before any call
    prompts = first_of_each_category(load_prompts("eval"), per_category)
    rows = []
    for repeat in range(repeats):
        for index, labelled in enumerate(prompts):
            given = labelled.prompt
            model = models["A"]
            ids = model.prompt_ids(messages=given) if isinstance(given, list) else model.prompt_ids(prompt=given)
            row, outputs = {"category": labelled.category, "repeat": repeat}, set()
            for which, mode in RUNS if (repeat + index) % 2 == 0 else RUNS[::-1]:
                result = models[which].generate(prompt_ids=ids, mode=mode, max_new_tokens=128)
                row[f"{which}_{mode}"] = result.stats.tokens_per_second
                row[f"{which}_{mode}_prefill_s"] = result.stats.prefill_seconds
                outputs.add(tuple(result.token_ids))
            row["identical"] = len(outputs) == 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {f"{key} / {base}": [r[key] / r[base] for r in rows] for key, base in RATIOS}
    for name, values in summary.items():
        print(name, spread(values))
    categories = sorted({r["category"] for r in rows})
    for key in ("A_paradecode", "B_paradecode"):
        of = {c: [r[key] / r[key[0] + "_ar"] for r in rows if r["category"] == c] for c in categories}
        medians = {c: statistics.median(v) for c, v in of.items()}
        print(key, "per category (per-run ratios' median):", {c: round(v, 3) for c, v in medians.items()})
        print(key, "median over categories", round(statistics.median(medians.values()), 3))
    for which in ("A", "B"):
        print(f"{which} prefill seconds (ar)", spread([r[f"{which}_ar_prefill_s"] for r in rows]))
    print("all outputs identical:", all(r["identical"] for r in rows))
    with open(out, "w") as file:
        json.dump({"export": path, "b_first": b_first, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], "--b-first" in sys.argv[5:])
