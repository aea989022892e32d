"""`paradecode-profile DIR`: where decoding time goes, lane by lane.

Runs one generation with every subgraph call recorded, and writes
- a Chrome / Perfetto trace (`--trace OUT.json`; open in chrome://tracing or ui.perfetto.dev):
  one track per lane with every call (subgraph, positions), and a track of scheduler phases
  (prefill, verify, rollback);
- a PNG timeline of the same (`--png`, default: the trace's name with .png);
- NVTX ranges for every call and phase (the `nvtx` package; a no-op without a GPU or profiler),
  and on CUDA a cudaProfilerApi range around decoding, so that
      nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx \\
          -o paradecode paradecode-profile DIR --device cuda --backend torch
  captures the decode region only.
It prints per-lane busy time and how long the two busiest lanes ran at the same time. With
`--torch-profiler` on CUDA it also reads the CUPTI trace back: kernel time per CUDA stream, how long two
streams' kernels ran at once (host-side lane overlap is not GPU overlap), the share of wall time the GPU
ran any kernel, and a PNG of the two busiest streams (the trace's name with .png).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from paradecode.graphs.errors import run_command
from paradecode.runtime.backends import BACKENDS
from paradecode.runtime.decoding_flags import add_decoding_flags

logger = logging.getLogger("paradecode.profile")
NSYS = (
    "nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx -o paradecode "
    "paradecode-profile DIR --device cuda"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paradecode-profile", description=__doc__.splitlines()[0], epilog=f"Nsight Systems: {NSYS}"
    )
    parser.add_argument("export", metavar="DIR")
    parser.add_argument("--prompt", default="def fibonacci(n):\n", help="prompt text (default: a line of code)")
    parser.add_argument("--prompt-ids", help="prompt as comma-separated ids (for exports without a tokenizer)")
    add_decoding_flags(parser, defaults={"--overlap": "both"})  # both lanes' work on the timeline
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="onnxruntime")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--trace", type=Path, default=Path("paradecode-trace.json"), metavar="OUT.json")
    parser.add_argument("--png", type=Path, metavar="OUT.png", help="timeline picture (default: next to --trace)")
    parser.add_argument(
        "--torch-profiler",
        type=Path,
        metavar="OUT.json",
        help="also record a torch.profiler trace (CUDA kernels per stream through CUPTI on a GPU)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    code, report = run_command("paradecode-profile", lambda: run(args))
    if code == 0:
        print(report)
    return code


def nvtx_annotator():
    """`name -> context manager` emitting NVTX ranges; None (with a note) where the nvtx package is missing."""
    try:
        import nvtx
    except ImportError:
        logger.info("the nvtx package is not installed (pip install nvtx): no NVTX ranges")
        return None
    return lambda name: nvtx.annotate(name, domain="paradecode")


def run(args) -> str:
    import torch

    from paradecode.runtime import GenerationConfig, Tracing, load
    from paradecode.runtime.decoding_flags import decoding_fields
    from paradecode.tools.reporting import save_figure, save_json

    model = load(args.export, backend=args.backend, device=args.device, lanes=args.lanes)
    config = GenerationConfig(**decoding_fields(args))
    ids = [int(i) for i in args.prompt_ids.split(",")] if args.prompt_ids else None
    prompt = None if ids else args.prompt
    model.generate(prompt, prompt_ids=ids, config=GenerationConfig(max_new_tokens=8))  # warm-up
    annotate = nvtx_annotator()
    cuda = args.device == "cuda" and torch.cuda.is_available()
    capture = torch.cuda.profiler.profile() if cuda else contextlib.nullcontext()
    kernels = contextlib.nullcontext()
    if args.torch_profiler:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        kernels = torch.profiler.profile(activities=activities)
    with capture, kernels as recorded:
        result = model.generate(
            prompt,
            prompt_ids=ids,
            config=config,
            tracing=Tracing(spans=True, annotate=annotate or (lambda name: contextlib.nullcontext())),
        )
    if args.torch_profiler:
        args.torch_profiler.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.torch_profiler.with_name(f".{args.torch_profiler.name}.tmp")
        recorded.export_chrome_trace(str(tmp))
        tmp.replace(args.torch_profiler)
    model.close()
    spans = result.timeline.spans
    save_json(args.trace, chrome_trace(spans, {"export": str(args.export), "stats": result.stats.to_dict()}))
    png = args.png or args.trace.with_suffix(".png")
    title = f"{Path(args.export).name}: {result.stats.mode} {result.stats.overlap}, {args.backend} on {args.device}"
    save_figure(png, timeline_figure(spans, title))
    busy = lane_busy(spans)
    lines = [
        f"wrote {args.trace} and {png}" + (f" and {args.torch_profiler}" if args.torch_profiler else ""),
        f"{result.stats.new_tokens} tokens, {result.stats.tokens_per_second:.1f} tokens/s, "
        f"exits {result.stats.exits_per_layer}, rollbacks {result.stats.rollbacks}",
    ]
    lines += [f"  lane {lane}: busy {seconds * 1e3:.1f} ms" for lane, seconds in busy]
    if len(busy) >= 2:
        a, b = busy[0][0], busy[1][0]
        lines.append(f"  lanes {a} and {b} ran at the same time for {overlap_seconds(spans, a, b) * 1e3:.1f} ms")
    if args.torch_profiler and cuda:
        kernel_png = args.torch_profiler.with_suffix(".png")
        lines += kernel_report(args.torch_profiler, kernel_png)
    return "\n".join(lines)


def kernel_intervals(trace: Path) -> dict[int, list[tuple[float, float]]]:
    """CUDA stream -> its kernels' (start, end) in microseconds, from a torch.profiler Chrome trace."""
    events = json.loads(Path(trace).read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    streams: dict[int, list[tuple[float, float]]] = {}
    for event in events:
        if event.get("cat") == "kernel" and "dur" in event:
            stream = event.get("args", {}).get("stream", -1)
            streams.setdefault(stream, []).append((event["ts"], event["ts"] + event["dur"]))
    return streams


def kernel_report(trace: Path, png: Path, window_ms: float = 5.0) -> list[str]:
    """What the GPU did: kernel time per stream, the time two streams' kernels ran at once, the share of the
    traced wall time the GPU ran any kernel, and a PNG of the two busiest streams over `window_ms` from where
    they first overlap."""
    streams = kernel_intervals(trace)
    if not streams:
        return [f"  {trace}: no CUDA kernels recorded"]
    ranked = sorted(streams, key=lambda s: -sum(e - b for b, e in streams[s]))
    every = [iv for ivs in streams.values() for iv in ivs]
    start, end = min(b for b, _ in every), max(e for _, e in every)
    busy_any = sum(e - b for b, e in _merged(every))
    lines = [f"  kernels: {len(every)} on {len(streams)} streams over {(end - start) / 1e3:.1f} ms"]
    lines += [
        f"  stream {s}: {len(streams[s])} kernels, {sum(e - b for b, e in streams[s]) / 1e3:.1f} ms" for s in ranked
    ]
    lines.append(f"  the GPU ran a kernel {100 * busy_any / max(end - start, 1e-9):.0f}% of that time")
    if len(ranked) >= 2:
        a, b = ranked[0], ranked[1]
        both = _overlap(_merged(streams[a]), _merged(streams[b]))
        lines.append(f"  streams {a} and {b} ran kernels at the same time for {both / 1e3:.2f} ms")
        from paradecode.tools.reporting import save_figure

        save_figure(png, kernel_figure({s: streams[s] for s in ranked[:2]}, start, window_ms, Path(trace).name))
        lines.append(f"  wrote {png}")
    return lines


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_figure(streams: dict[int, list[tuple[float, float]]], origin: float, window_ms: float, title: str):
    """Kernels per stream over the `window_ms` after the first overlap of the two streams (or the start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first, second = (_merged(v) for v in streams.values())
    starts = [max(x[0], y[0]) for x in first for y in second if min(x[1], y[1]) > max(x[0], y[0])]
    begin = min(starts) - 200 if starts else origin
    stop = begin + window_ms * 1e3
    figure, axis = plt.subplots(figsize=(14, 2.4))
    for row, intervals in enumerate(streams.values()):
        bars = [((b - begin) / 1e3, max((e - b) / 1e3, 0.002)) for b, e in intervals if e > begin and b < stop]
        axis.broken_barh(bars, (row - 0.4, 0.8), color=f"C{row}")
    axis.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    axis.set_xlim(0, window_ms)
    axis.set_xlabel("milliseconds")
    axis.set_title(f"CUDA kernels per stream ({title})")
    return figure


def lane_busy(spans) -> list[tuple[str, float]]:
    busy: dict[str, float] = {}
    for s in spans:
        if s.lane != "phases":
            busy[s.lane] = busy.get(s.lane, 0.0) + s.end - s.start
    return sorted(busy.items(), key=lambda kv: -kv[1])


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap_seconds(spans, lane_a: str, lane_b: str) -> float:
    """Total time during which both lanes were inside a call."""
    a = _merged([(s.start, s.end) for s in spans if s.lane == lane_a])
    b = _merged([(s.start, s.end) for s in spans if s.lane == lane_b])
    return _overlap(a, b)


def chrome_trace(spans, metadata: dict) -> dict:
    """Trace Event Format: one thread per lane, complete ("X") events in microseconds."""
    origin = min((s.start for s in spans), default=0.0)
    lanes = sorted({s.lane for s in spans}, key=lambda lane: (lane == "phases", lane != "main", lane))
    tid = {lane: i for i, lane in enumerate(lanes)}
    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[lane], "args": {"name": f"lane {lane}"}}
        for lane in lanes
    ]
    for s in spans:
        events.append(
            {
                "name": s.name,
                "cat": "phase" if s.lane == "phases" else "subgraph",
                "ph": "X",
                "pid": 0,
                "tid": tid[s.lane],
                "ts": (s.start - origin) * 1e6,
                "dur": (s.end - s.start) * 1e6,
                "args": {"positions": f"{s.positions[0]}-{s.positions[1] - 1}"},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}


def timeline_figure(spans, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min((s.start for s in spans), default=0.0)
    lanes = sorted({s.lane for s in spans}, key=lambda lane: (lane == "phases", lane != "main", lane))
    colors = {
        "embed": "tab:grey",
        "layer": "tab:blue",
        "exit": "tab:orange",
        "final": "tab:green",
        "prefill": "tab:purple",
        "verify": "tab:olive",
        "rollback": "tab:red",
    }
    figure, axis = plt.subplots(figsize=(14, 1.2 + 0.8 * len(lanes)))
    for row, lane in enumerate(lanes):
        for kind, color in colors.items():
            bars = [
                ((s.start - origin) * 1e3, max((s.end - s.start) * 1e3, 0.02))
                for s in spans
                if s.lane == lane and s.name.startswith(kind)
            ]
            if bars:
                axis.broken_barh(bars, (row - 0.4, 0.8), color=color, label=kind)
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axis.legend(unique.values(), unique.keys(), loc="upper right", ncol=len(unique), fontsize=8)
    axis.set_yticks(range(len(lanes)), [f"lane {lane}" for lane in lanes])
    axis.set_xlabel("milliseconds")
    axis.set_title(title)
    return figure


if __name__ == "__main__":
    sys.exit(main())
