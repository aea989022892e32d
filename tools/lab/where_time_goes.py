"""Where a plain-decoding (ar) token's time goes on the torch backend with CUDA graphs and segments.

    python tools/lab/where_time_goes.py OUT_DIR [--device cuda] [--small] [--compile]

A random Llama of SmolLM2-135M's layer shape (or --small: a tiny one, for a dry run on a CPU), exported with
one exit layer (8) so ar runs embed, segment 1-8, segment 9-30 and the final head. Reports the wall time per
token, the host time inside each subgraph call (no synchronisation), the same calls each synchronised
before and after (host + device), and torch.profiler's device time per token with its top kernels. With
--compile, then the same export loaded with `torch_compile=True` (Inductor fuses the small kernels; the backend
still captures each call as a CUDA graph): its wall time per token, interleaved with the eager model's, its
device time and kernel launches per token, and whether its tokens equal the eager modules'. The H200 figures
of 2026-11-26 (tools/results/NVIDIA-H200/) were taken with an earlier form of this script, which compiled the
modules in place (`torch.compile(dynamic=False)`).
"""

import collections
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from paradecode.export.config import ExportConfig
from paradecode.export.pipeline import export_model
from paradecode.runtime import load
from paradecode.tools.characterise import build_model


def main() -> int:
    """Measure and write OUT_DIR/where-time-goes.json and where-time-goes-profile.txt (see the docstring)."""
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    small = "--small" in sys.argv
    shape = (
        SimpleNamespace(vocab=512, hidden=64, ffn=128, layers=10, heads=4, kv_heads=2)
        if small
        else SimpleNamespace(vocab=49152, hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3)
    )
    work = Path("/tmp/where-time-goes-small" if small else "/tmp/where-time-goes")
    if not (work / "export" / "manifest.json").is_file():
        build_model(shape, work / "model")
        export_model(
            ExportConfig(
                model=str(work / "model"), output=work / "export", exit_layers=(8,), max_seq_len=256, force=True
            )
        )
    model = load(work / "export", backend="torch", device=device)
    prompt = list(range(5, 21))
    TOKENS = 128

    def generate(which=model, n=TOKENS):
        return which.generate(prompt_ids=prompt, max_new_tokens=n, mode="ar", ignore_eos=True)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    report = {"shape": vars(shape), "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    generate()
    generate()
    walls = []
    for _ in range(5):
        sync()
        began = time.perf_counter()
        result = generate()
        sync()
        walls.append(1000 * (time.perf_counter() - began) / TOKENS)
    report["wall_ms_per_token"] = sorted(walls)
    report["runtime_tokens_per_second"] = result.stats.tokens_per_second
    report["calls_per_token"] = result.stats.calls / TOKENS

    backend = model.backend
    original = backend.run

    def timed(synchronised):
        spent, counts = collections.Counter(), collections.Counter()

        def run(name, feeds, lane="main", outputs=None):
            if synchronised:
                sync()
            began = time.perf_counter()
            value = original(name, feeds, lane, outputs)
            if synchronised:
                sync()
            spent[name] += time.perf_counter() - began
            counts[name] += 1
            return value

        backend.run = run
        began = time.perf_counter()
        generate()
        wall = time.perf_counter() - began
        backend.run = original
        per_call = {name: {"calls": counts[name], "us_per_call": 1e6 * spent[name] / counts[name]} for name in spent}
        return {
            "wall_ms_per_token": 1000 * wall / TOKENS,
            "in_calls_ms_per_token": 1000 * sum(spent.values()) / TOKENS,
            "per_call": per_call,
        }

    report["host_in_calls"] = timed(False)
    report["synchronised_calls"] = timed(True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        generate(model, 32)
    events = profile.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    report["profiler_device_ms_per_token"] = device_us / 1000 / 32
    report["top_kernels"] = [
        {"name": e.key[:90], "count": e.count, "device_us": getattr(e, "self_device_time_total", 0)}
        for e in sorted(events, key=lambda e: -getattr(e, "self_device_time_total", 0))[:20]
    ]
    (out / "where-time-goes.json").write_text(json.dumps(report, indent=1))
    (out / "where-time-goes-profile.txt").write_text(
        events.table(sort_by="self_device_time_total" if device == "cuda" else "self_cpu_time_total", row_limit=40)
    )
    print(json.dumps({k: v for k, v in report.items() if k != "top_kernels"}, indent=1))
    print(json.dumps(report["top_kernels"][:12], indent=1))

    if "--compile" in sys.argv:
        # The backend's own option (`torch_compile=True`): a second model, its modules compiled, interleaved with the
        # eager one so the two are measured side by side.
        reference = result.token_ids
        began = time.perf_counter()
        compiled = load(work / "export", backend="torch", device=device, torch_compile=True)
        first = generate(compiled)
        compiled_report = {
            "first_generate_seconds": time.perf_counter() - began,
            "same_tokens": first.token_ids == reference,
        }
        generate(compiled)
        walls = {"eager": [], "compiled": []}
        for _ in range(5):
            for name, which in (("eager", model), ("compiled", compiled)):
                sync()
                began = time.perf_counter()
                generate(which)
                sync()
                walls[name].append(1000 * (time.perf_counter() - began) / TOKENS)
        compiled_report["wall_ms_per_token"] = sorted(walls["compiled"])
        compiled_report["eager_wall_ms_per_token_interleaved"] = sorted(walls["eager"])
        with torch.profiler.profile(activities=activities) as profile:
            generate(compiled, 32)
        events = profile.key_averages()
        compiled_report["profiler_device_ms_per_token"] = (
            sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000 / 32
        )
        compiled_report["kernel_launches_per_token"] = (
            sum(e.count for e in events if getattr(e, "self_device_time_total", 0) > 0) / 32
        )
        compiled.close()
        report["compiled"] = compiled_report
        (out / "where-time-goes.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(compiled_report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
