"""Side-by-side decoding benchmarks: ar, ParaDecode and Hugging Face `generate`, interleaved.

Every mode runs on every prompt in turn (A B C A B C ...), after a warm-up, for R repeats, in one
process on one machine. Each run records its verified-token timestamps, so tokens/s and per-token
latency are measured the same way for every mode: tokens/s is (new tokens - 1) over the time from
the first new token to the last (the prefill is reported on its own), latency is the gap between
consecutive tokens.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):\n',
    "Once upon a time, there was a little girl",
    "The little dog wanted to play in the park.",
    "for i in range(10):\n",
)


@dataclass
class Sample:
    mode: str
    prompt: int
    repeat: int
    token_ids: list[int]
    first_token_seconds: float  # from the call to the first new token (prefill)
    timestamps: list[float]  # perf_counter time of each verified token
    exits: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)
    rollbacks: int = 0
    peak_rss_mb: float | None = None

    @property
    def tokens_per_second(self) -> float:
        if len(self.timestamps) < 2:
            return 0.0
        span = self.timestamps[-1] - self.timestamps[0]
        return (len(self.timestamps) - 1) / span if span > 0 else 0.0

    @property
    def latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.timestamps, self.timestamps[1:])]


@dataclass
class Mode:
    """A way to decode: `run(prompt_ids, max_new_tokens)` returns a Sample without mode/prompt/repeat."""

    name: str
    kind: str  # "ar", "paradecode" or "hf"
    run: Callable[[list[int], int], Sample]
    settings: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


def peak_rss_reset() -> float | None:
    """Reset the process's peak RSS (Linux) and return the current RSS in MB; None where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_mb("VmRSS")
    except OSError:
        return None


def _status_mb(key: str) -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return None


def load_with_ar_baselines(export, *, backend: str = "onnxruntime", device: str = "cpu"):
    """Load `export` for ParaDecode (2 lanes) plus the ar baselines worth measuring beside it.

    Returns (model, {label: model}). ar runs on the 2-lane model as it is (with onnxruntime each
    lane's calls get half the cores), and, with onnxruntime on a multi-core CPU, also on a 1-lane
    model whose calls use every core: plain decoding has no second lane to feed, so that is the
    fairer baseline there. Callers report the faster of the two as *the* ar.
    """
    from paradecode.runtime import load

    cores = os.cpu_count() or 1
    model = load(export, backend=backend, device=device, lanes=2)
    if backend != "onnxruntime":
        return model, {"ar": model}
    per_lane = max(1, cores // 2)
    baselines = {f"ar ({per_lane} thread{'s' if per_lane > 1 else ''}/call)": model}
    if cores > 1:
        baselines[f"ar ({cores} threads/call)"] = load(export, backend=backend, device=device, lanes=1, verify=False)
    return model, baselines


def close_all(model, baselines: dict) -> None:
    """Close what `load_with_ar_baselines` loaded (each model once)."""
    for m in {id(m): m for m in [model, *baselines.values()]}.values():
        m.close()


def paradecode_mode(name: str, model, settings: dict[str, Any], *, ignore_eos: bool) -> Mode:
    kind = "ar" if settings.get("mode") == "ar" else "paradecode"

    def run(prompt_ids: list[int], max_new_tokens: int) -> Sample:
        started = time.perf_counter()
        stream = model.stream(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, **settings)
        stamps = [time.perf_counter() for _ in stream]
        stats = stream.result.stats
        return Sample(
            name,
            0,
            0,
            stream.result.token_ids,
            stamps[0] - started if stamps else 0.0,
            stamps,
            dict(stats.exits_per_layer),
            dict(stats.accepted_per_layer),
            stats.rollbacks,
        )

    return Mode(name, kind, run, settings)


def hf_mode(name: str, model, kwargs: dict[str, Any], *, ignore_eos: bool) -> Mode:
    """Hugging Face generate(do_sample=False), timed per token through a streamer."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.stamps: list[float] = []
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:  # generate first puts the prompt itself
                self.prompt_seen = True
                return
            now = time.perf_counter()
            self.stamps.extend([now] * value.reshape(-1).numel())  # assisted decoding puts several at once

        def end(self):
            pass

    def run(prompt_ids: list[int], max_new_tokens: int) -> Sample:
        streamer = Stamps()
        extra = {"eos_token_id": None} if ignore_eos else {}
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                streamer=streamer,
                pad_token_id=0,
                **extra,
                **kwargs,
            )
        tokens = out[0, len(prompt_ids) :].tolist()
        stamps = streamer.stamps[: len(tokens)]
        return Sample(name, 0, 0, tokens, stamps[0] - started if stamps else 0.0, stamps)

    return Mode(name, "hf", run, kwargs)


def run_benchmark(
    modes: list[Mode],
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    repeat: int,
    warmup_tokens: int = 16,
    progress: Callable[[str], None] = logger.info,
) -> list[Sample]:
    """Warm every mode up, then run every mode on every prompt, interleaved, `repeat` times."""
    active = []
    for mode in modes:
        try:
            mode.run(prompts[0], warmup_tokens)
            active.append(mode)
        except Exception as err:  # a mode the model or library does not support: reported, not fatal
            mode.skipped = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            progress(f"skipping {mode.name}: {mode.skipped}")
    samples, started, total = [], time.perf_counter(), repeat * len(prompts)
    for r in range(repeat):
        for p, prompt in enumerate(prompts):
            for mode in active:
                before = peak_rss_reset()
                sample = mode.run(prompt, max_new_tokens)
                peak = _status_mb("VmHWM") if before is not None else None
                sample.mode, sample.prompt, sample.repeat = mode.name, p, r
                sample.peak_rss_mb = None if peak is None else max(0.0, peak - before)
                samples.append(sample)
            done = r * len(prompts) + p + 1
            elapsed = time.perf_counter() - started
            progress(
                f"[{done}/{total}] repeat {r + 1}, prompt {p + 1}: {elapsed:.0f} s elapsed, "
                f"about {elapsed / done * (total - done):.0f} s to go"
            )
    return samples


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(modes: list[Mode], samples: list[Sample]) -> dict[str, dict[str, Any]]:
    """Per mode: medians, latency percentiles, speedups vs ar and vs HF (median, min, max over repeats)."""
    by_mode: dict[str, list[Sample]] = {}
    for s in samples:
        by_mode.setdefault(s.mode, []).append(s)
    kinds = {m.name: m.kind for m in modes}

    def per_repeat(name: str) -> dict[int, float]:
        groups: dict[int, list[float]] = {}
        for s in by_mode.get(name, []):
            groups.setdefault(s.repeat, []).append(s.tokens_per_second)
        return {r: statistics.median(v) for r, v in groups.items()}

    ar_names = [n for n in by_mode if kinds[n] == "ar"]
    baseline = max(ar_names, key=lambda n: statistics.median(s.tokens_per_second for s in by_mode[n]), default=None)
    hf = "hf" if "hf" in by_mode else None
    reference = {(s.prompt, s.repeat): s.token_ids for s in by_mode.get(baseline, [])}
    summary = {}
    for mode in modes:
        runs = by_mode.get(mode.name)
        if not runs:
            summary[mode.name] = {"kind": mode.kind, "skipped": mode.skipped or "no samples"}
            continue
        mine = per_repeat(mode.name)
        row: dict[str, Any] = {
            "kind": mode.kind,
            "settings": {k: v for k, v in mode.settings.items() if not callable(v)},
            "tokens_per_second": statistics.median(s.tokens_per_second for s in runs),
            "latency_ms_p50": 1e3 * percentile([x for s in runs for x in s.latencies], 0.5),
            "latency_ms_p95": 1e3 * percentile([x for s in runs for x in s.latencies], 0.95),
            "first_token_ms": 1e3 * statistics.median(s.first_token_seconds for s in runs),
            "new_tokens": statistics.median(len(s.token_ids) for s in runs),
            "exact_match_vs_ar": sum(s.token_ids == reference.get((s.prompt, s.repeat)) for s in runs) / len(runs),
            "peak_rss_mb": max((s.peak_rss_mb for s in runs if s.peak_rss_mb is not None), default=None),
        }
        for label, base in (("ar", baseline), ("hf", hf)):
            if base is None:
                continue
            theirs = per_repeat(base)
            ratios = [mine[r] / theirs[r] for r in mine if r in theirs and theirs[r] > 0]
            if ratios:
                row[f"speedup_vs_{label}"] = {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
        exits = _total(s.exits for s in runs)
        accepted = _total(s.accepted for s in runs)
        if exits:
            row["exits_per_layer"] = exits
            row["accepted_per_layer"] = accepted
            early = sum(exits.values())
            row["rollback_rate"] = sum(s.rollbacks for s in runs) / early if early else 0.0
        summary[mode.name] = row
    summary["_baseline"] = {"ar": baseline, "hf": hf}
    return summary


def _total(dicts: Iterable[dict[int, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[str(k)] = total.get(str(k), 0) + v
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def machine() -> dict[str, Any]:
    import platform

    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def samples_as_dicts(samples: list[Sample]) -> list[dict[str, Any]]:
    rows = []
    for s in samples:
        row = asdict(s)
        row.pop("timestamps")
        row["tokens_per_second"] = s.tokens_per_second
        rows.append(row)
    return rows
