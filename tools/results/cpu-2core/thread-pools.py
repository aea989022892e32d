"""onnxruntime's thread pools, A/B: each setting decodes the same prompts in processes of its own, alternated
(tools/results/cpu-2core/thread-pools.md).

    python tools/results/cpu-2core/thread-pools.py EXPORT ROUNDS PER_CATEGORY TOKENS OUT.json [BEFORE_PATH]

Settings: `spinning` (the runtime's default: a pool of every core per session, spinning while its call runs),
`global` (the same code with onnxruntime's global thread pools: one pool of every core for every session of the
process), and, where BEFORE_PATH is given, `before` (a checkout of the runtime before the change, put first on
PYTHONPATH as `paradecode`: layer graphs on one thread, heads and prefills on every core, idle threads sleeping).
Each process decodes the `eval` prompts (PER_CATEGORY of each category) greedily, TOKENS new tokens, plain
decoding and ParaDecode with the defaults, after one warm-up prompt; it reports tokens/s per mode (the sum of
tokens over the sum of wall times) and whether every ParaDecode output equalled plain decoding's. A setting's
figure is the median over ROUNDS processes, with their min and max.
"""

import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = ("spinning", "global", "before")


def child(export: str, setting: str, per_category: int, tokens: int) -> None:
    if setting == "global":
        import onnxruntime as ort

        from paradecode.runtime.backends import onnxruntime_backend

        ort.set_global_thread_pool_sizes(os.cpu_count() or 1, 1)
        plain = onnxruntime_backend.OnnxRuntimeBackend._options

        def shared(self, *args):
            options = plain(self, *args)
            options.use_per_session_threads = False
            return options

        onnxruntime_backend.OnnxRuntimeBackend._options = shared
    from paradecode.export.prompt_sets import load_prompts
    from paradecode.runtime import load
    from paradecode.tools.bench import first_of_each_category

    prompts = [p.prompt for p in first_of_each_category(load_prompts("eval"), per_category)]
    with load(export) as model:
        result = {"setting": setting, "modes": {}, "same": True}
        outputs = {}
        for mode in ("ar", "paradecode"):
            model.generate(messages=prompts[0], max_new_tokens=16, mode=mode)
            count, wall, outs = 0, 0.0, []
            for prompt in prompts:
                began = time.perf_counter()
                out = model.generate(messages=prompt, max_new_tokens=tokens, mode=mode)
                wall += time.perf_counter() - began
                count += len(out.token_ids)
                outs.append(out.token_ids)
            result["modes"][mode] = count / wall
            outputs[mode] = outs
        result["same"] = outputs["ar"] == outputs["paradecode"]
    print(json.dumps(result))


def main(argv: list[str]) -> None:
    if argv[0] == "--child":
        child(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return
    export, rounds, per_category, tokens, out = argv[0], int(argv[1]), argv[2], argv[3], argv[4]
    before = argv[5] if len(argv) > 5 else None
    settings = [s for s in SETTINGS if s != "before" or before]
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for round_ in range(rounds):
        for setting in settings if round_ % 2 == 0 else reversed(settings):
            env = dict(os.environ)
            if setting == "before":
                env["PYTHONPATH"] = before + os.pathsep + env.get("PYTHONPATH", "")
            command = [sys.executable, __file__, "--child", export, setting, per_category, tokens]
            line = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            runs[setting].append(json.loads(line))
            print(round_, line, flush=True)
    summary = {}
    for setting, results in runs.items():
        summary[setting] = {"same": all(r["same"] for r in results)}
        for mode in ("ar", "paradecode"):
            values = [r["modes"][mode] for r in results]
            summary[setting][mode] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    with open(out, "w") as f:
        json.dump(
            {
                "export": export,
                "rounds": rounds,
                "per_category": int(per_category),
                "tokens": int(tokens),
                "summary": summary,
                "runs": runs,
            },
            f,
            indent=1,
        )
    for setting, s in summary.items():
        print(
            setting,
            {m: f"{v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})" for m, v in s.items() if m != "same"},
            "ParaDecode = ar" if s["same"] else "ParaDecode != ar",
        )


if __name__ == "__main__":
    main(sys.argv[1:])
