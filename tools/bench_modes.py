"""What the measuring tools decode with: modes over paradecode and Hugging Face models, and bench's summary.

The harness (`paradecode.tools.harness`) runs the modes made here interleaved and computes the
statistics. `stream_mode` times every verified token (tokens/s is (new tokens - 1) over the time
from the first new token to the last; latency is the gap between consecutive tokens), as `hf_mode`
does through a streamer; `generate_mode` takes the runtime's own measurement (`GenerationStats`) and
accepts every `generate` setting, `tracing` included. `load_with_ar_baselines` loads a model with
the plain-decoding baselines worth measuring beside it; the harness picks the faster as *the* ar.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any

from paradecode.export.heads.call_costs import CallCosts
from paradecode.export.heads.cost_model import CostModel
from paradecode.tools.harness import Mode, Results, Sample

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):\n',
    "Once upon a time, there was a little girl",
    "The little dog wanted to play in the park.",
    "for i in range(10):\n",
)
UNCATEGORISED = "uncategorised"  # the group of prompts without a category, where others have one


DEQUANTIZED = "ar (dequantized)"  # `load_with_ar_baselines`' row of the same export without int4 kernels


def load_with_ar_baselines(
    export,
    *,
    backend: str = "onnxruntime",
    device: str = "cpu",
    torch_compile: bool = False,
    int4_kernels: bool = False,
):
    """Load `export` for ParaDecode as `load` does by default (2 lanes; with onnxruntime every core per call), plus
    the ar baselines worth measuring beside it.

    Returns (model, {label: model}). ar runs on that model, and, with onnxruntime on a multi-core CPU, also on a
    1-lane model whose calls use one thread each, and one whose calls use every core, where the model's own calls
    use another count (else its row would repeat "ar (default threads)"): which is the faster plain decoding depends
    on the model and the machine. The harness reports the fastest as *the* ar
    (`Results.baseline`). With `torch_compile` (the torch backend), the model's modules are compiled, and ar also
    runs on a model without compilation, `ar (eager)`, so the two are measured side by side; where the torch
    backend reads 4-bit weights with int4 kernels (`int4_kernels`), ar also runs on the same export dequantized,
    `ar (dequantized)` (DEQUANTIZED), instead: another engine's plain decoding (other numerics, other tokens), which
    the bench reports beside ar as a reference row, never as the baseline.
    """
    from paradecode.runtime import load

    cores = os.cpu_count() or 1
    model = load(
        export, backend=backend, device=device, lanes=2, torch_compile=torch_compile, int4_kernels=int4_kernels
    )
    if int4_kernels:  # the same export dequantized beside them
        try:
            dequantized = load(
                export,
                backend=backend,
                device=device,
                lanes=1,
                torch_compile=torch_compile,
                int4_kernels=False,
                verify=False,
            )
        except BaseException:
            model.close()
            raise
        return model, {"ar": model, DEQUANTIZED: dequantized}
    if torch_compile:
        try:
            eager = load(export, backend=backend, device=device, lanes=1, verify=False)
        except BaseException:
            model.close()
            raise
        return model, {"ar": model, "ar (eager)": eager}
    if backend != "onnxruntime":
        return model, {"ar": model}
    baselines = {"ar (default threads)": model}
    if cores > 1:
        try:
            for count in (1, cores):
                if count == model.backend.threads:  # the model's own plain decoding makes these calls: no new row
                    continue
                baselines[f"ar ({count} thread{'s' if count > 1 else ''}/call)"] = load(
                    export, backend=backend, device=device, lanes=1, threads=count, verify=False
                )
        except BaseException:
            close_all(model, baselines)
            raise
    return model, baselines


def close_all(model, baselines: dict) -> None:
    """Close what `load_with_ar_baselines` loaded (each model once)."""
    for m in {id(m): m for m in [model, *baselines.values()]}.values():
        m.close()


@contextmanager
def opened_with_ar_baselines(export, **options) -> Iterator[tuple]:
    """`load_with_ar_baselines` as a context manager: (model, {label: model}), all closed on leaving."""
    model, baselines = load_with_ar_baselines(export, **options)
    try:
        yield model, baselines
    finally:
        close_all(model, baselines)


def first_compile(model, prompt_ids: list[int], new_tokens: int = 16) -> dict[str, Any]:
    """With torch_compile: the time of the model's first generate (plain decoding, where its modules compile, or
    load from Inductor's cache, for the calls ar makes) and of the second (nothing left to compile), and the
    cache's hits and misses so far. Call it before anything else decodes with the model."""
    from paradecode.runtime.backends.torch_backend import compile_cache_counts

    seconds = []
    for _ in range(2):
        began = time.perf_counter()
        model.generate(prompt_ids=prompt_ids, max_new_tokens=new_tokens, mode="ar", ignore_eos=True)
        seconds.append(time.perf_counter() - began)
    return {
        "first_generate_seconds": seconds[0],
        "second_generate_seconds": seconds[1],
        "new_tokens": new_tokens,
        "cache_folder": str(model.backend.compile_cache),
        **compile_cache_counts(),
    }


def compile_line(report: dict[str, Any]) -> str:
    """`first_compile`'s report in one line."""
    return (
        f"torch.compile: first generate {report['first_generate_seconds']:.1f} s, the next "
        f"{report['second_generate_seconds']:.2f} s ({report['new_tokens']} tokens, ar); Inductor's cache "
        f"{report['fx_graph_hits']} hits, {report['fx_graph_misses']} misses ({report['cache_folder']})"
    )


def _kind(settings: dict[str, Any]) -> str:
    return "ar" if settings.get("mode") == "ar" else "paradecode"


def stream_mode(name: str, model, settings: dict[str, Any], *, ignore_eos: bool) -> Mode:
    """Decode with `model.stream(**settings)`, timing every verified token as it arrives."""

    def run(prompt_ids: list[int], max_new_tokens: int) -> Sample:
        started = time.perf_counter()
        stream = model.stream(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, **settings)
        stamps = [time.perf_counter() for _ in stream]
        stats = stream.result.stats
        return Sample.from_stamps(
            stream.result.token_ids,
            started,
            stamps,
            exits=dict(stats.exits_per_layer),
            accepted=dict(stats.accepted_per_layer),
            lookup_proposed=stats.lookup_proposed,
            lookup_accepted=stats.lookup_accepted,
            draft_proposed=stats.draft_proposed,
            draft_accepted=stats.draft_accepted,
            rollbacks=stats.rollbacks,
        )

    return Mode(name, _kind(settings), run, settings)


def generate_mode(name: str, model, settings: dict[str, Any]) -> Mode:
    """Decode with `model.generate(**settings)`; tokens/s as the runtime measured it (`GenerationStats`)."""

    def run(prompt_ids: list[int], max_new_tokens: int) -> Sample:
        result = model.generate(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, **settings)
        stats = result.stats
        return Sample(
            token_ids=result.token_ids,
            first_token_seconds=stats.prefill_seconds,
            exits=dict(stats.exits_per_layer),
            accepted=dict(stats.accepted_per_layer),
            lookup_proposed=stats.lookup_proposed,
            lookup_accepted=stats.lookup_accepted,
            draft_proposed=stats.draft_proposed,
            draft_accepted=stats.draft_accepted,
            rollbacks=stats.rollbacks,
            tokens_per_second=stats.tokens_per_second,
        )

    return Mode(name, _kind(settings), run, settings)


def hf_mode(name: str, model, kwargs: dict[str, Any], *, ignore_eos: bool) -> Mode:
    """Hugging Face generate (greedy, or sampling where `kwargs` say do_sample=True), timed per token through a
    streamer."""
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
                torch.tensor([prompt_ids], device=model.device),
                max_new_tokens=max_new_tokens,
                streamer=streamer,
                pad_token_id=0,
                **{"do_sample": False, **extra, **kwargs},
            )
        tokens = out[0, len(prompt_ids) :].tolist()
        return Sample.from_stamps(tokens, started, streamer.stamps[: len(tokens)])

    return Mode(name, "hf", run, kwargs)


def summarize(
    results: Results, *, baseline: str | None = None, bound: Callable[[Mode, dict, int], float | None] | None = None
) -> dict[str, dict[str, Any]]:
    """bench's summary per mode: medians, latency percentiles, speedups vs ar and vs HF (median, min, max over
    repeats), agreement with ar (exact runs, identical leading tokens, per prompt), exits; `_baseline` names
    the ar and HF modes the speedups are against (the ar one: `baseline`, or where None the results' own).
    `bound(mode, accepted per layer, tokens)` gives a mode's speedup bound at its measured acceptance (None
    where it has none)."""
    baseline = baseline or results.baseline
    hf = "hf" if results.runs("hf") else None
    summary = {}
    for mode in results.modes:
        runs = results.runs(mode.name)
        if not runs:
            summary[mode.name] = {"kind": mode.kind, "skipped": results.skipped.get(mode.name, "no samples")}
            continue
        p50, p95 = results.latency_ms(mode.name, (50, 95))
        row: dict[str, Any] = {
            "kind": mode.kind,
            "settings": {k: v for k, v in mode.settings.items() if k != "tracing" and not callable(v)},
            "tokens_per_second": results.tokens_per_second(mode.name).median,
            "latency_ms_p50": p50,
            "latency_ms_p95": p95,
            "first_token_ms": 1e3 * statistics.median(s.first_token_seconds for s in runs),
            "new_tokens": statistics.median(len(s.token_ids) for s in runs),
            "exact_match_vs_ar": results.matches(mode.name, baseline) / len(runs),
            "leading_match_vs_ar": results.leading_match(mode.name, baseline),
            "identical_to_ar_per_prompt": results.identical_per_prompt(mode.name, baseline),
            "peak_rss_mb": max((s.peak_rss_mb for s in runs if s.peak_rss_mb is not None), default=None),
        }
        for label, base in (("ar", baseline), ("hf", hf)):
            speedup = results.speedup(mode.name, base)
            if speedup is not None:
                row[f"speedup_vs_{label}"] = speedup.as_dict()
        per_prompt = results.speedup(mode.name, baseline, per="run")
        if per_prompt is not None:  # one ratio per prompt and repeat: how much the prompt matters
            row["speedup_vs_ar_per_run"] = per_prompt.as_dict()
        exits = results.exits(mode.name)
        looked_up, lookup_accepted = results.lookup(mode.name)
        if exits:
            row["exits_per_layer"] = exits
            row["accepted_per_layer"] = results.accepted(mode.name)
            limit = bound(mode, row["accepted_per_layer"], sum(len(s.token_ids) for s in runs)) if bound else None
            if limit is not None:
                row["bound_vs_ar"] = limit
        if looked_up:
            row["lookup_proposed"], row["lookup_accepted"] = looked_up, lookup_accepted
        drafted, draft_accepted = results.draft(mode.name)
        if drafted:
            row["draft_proposed"], row["draft_accepted"] = drafted, draft_accepted
        proposed = sum(exits.values()) + looked_up + drafted
        if proposed:
            row["rollback_rate"] = results.rollbacks(mode.name) / proposed
        summary[mode.name] = row
    summary["_baseline"] = {"ar": baseline, "hf": hf}
    return summary


def summarize_by_category(
    results: Results, categories: Sequence[str | None], bound: Callable[[Mode, dict, int], float | None] | None = None
) -> dict[str, dict[str, Any]]:
    """bench's summary per prompt category, in order of first appearance: {category: {"prompts": [indices],
    "summary": ...}}, every speedup against the baseline of all prompts so categories compare.

    `categories[i]` is prompt i's; prompts without one are grouped as UNCATEGORISED; {} when none has one.
    """
    if all(c is None for c in categories):
        return {}
    groups: dict[str, list[int]] = {}
    for index, category in enumerate(categories):
        groups.setdefault(category or UNCATEGORISED, []).append(index)
    baseline = results.baseline
    return {
        name: {"prompts": indices, "summary": summarize(results.of_prompts(indices), baseline=baseline, bound=bound)}
        for name, indices in groups.items()
    }


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
    """Every sample as JSON-ready data, without the per-token timestamps."""
    rows = []
    for s in samples:
        row = asdict(s)
        row.pop("timestamps")
        rows.append(row)
    return rows


def exit_bound(costs: CallCosts, accepted: dict[str, int], tokens: int, num_layers: int, active: list[int]) -> float:
    """The speedup bound of docs/design.md §6 for `batched` at the measured acceptance, by the cost model
    (`cost_model.CostModel`) of the measured calls: every accepted early token costs its layers up to its exit,
    the heads it passed and, for each remaining layer, one more position in a later token's call (what it adds
    to the largest batched layer call measured); every other token costs every layer and every active head;
    every token the whole final head; no embedding, no rollback, no overhead. `accepted` maps exit layers (as
    strings) to accepted early tokens, out of `tokens` generated; layers not in `active` are ignored."""
    measured = CostModel.measured(num_layers, costs, merge_tokens=max(costs.layer))
    model = replace(measured, other=0.0, final_merge=measured.final_head, rollback=0.0)
    return model.speedup({int(e): n / tokens for e, n in accepted.items() if int(e) in active}, active)


def copy_bandwidth(device: str, megabytes: int = 256) -> float:
    """Measured device memory copy bandwidth, bytes per second (read + write counted once, as a decode reads)."""
    import torch

    source = torch.empty(megabytes << 18, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    return source.numel() * source.element_size() / best_seconds(lambda: target.copy_(source), device)


def read_bandwidth(device: str, dtype: str = "float32", megabytes: int = 512) -> dict[str, float]:
    """Measured device memory read rates, bytes read per second: `sum`, a reduction over a float32 tensor of
    `megabytes`; `matvec`, a matrix of that size in `dtype` times a vector (how a decode step reads a weight).
    A decode step reads each weight once: weight bytes over the faster of the two is the read-bandwidth bound,
    about twice the copy bound where a copy's reads and writes share the bandwidth."""
    import torch

    data = torch.ones(megabytes << 18, dtype=torch.float32, device=device)
    rates = {"sum": data.numel() * 4 / best_seconds(data.sum, device)}
    del data
    kind = getattr(torch, dtype)
    columns = 4096
    matrix = torch.ones((megabytes << 20) // (kind.itemsize * columns), columns, dtype=kind, device=device)
    vector = torch.ones(columns, dtype=kind, device=device)
    rates["matvec"] = matrix.numel() * kind.itemsize / best_seconds(lambda: torch.mv(matrix, vector), device)
    return rates


def best_seconds(work: Callable[[], object], device: str, rounds: int = 5) -> float:
    """The fastest of `rounds` runs of `work` (after one untimed run), synchronised on CUDA."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    work()
    best = float("inf")
    for _ in range(rounds):
        sync()
        began = time.perf_counter()
        work()
        sync()
        best = min(best, time.perf_counter() - began)
    return best


def weight_bytes_per_token(export_dir) -> int:
    """Bytes of weights a plain decode step reads: every layer, the final norm and head, one embedding row
    (and one position row for learned positions); exit heads are not part of plain decoding. A quantized
    weight counts as its stored blocks (graphs/quantized_weights.py), as its graphs read it."""
    from safetensors import safe_open

    from paradecode.runtime.loader import open_export

    export = open_export(export_dir, verify=False)
    manifest = export.manifest
    itemsize = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1}
    total = 0
    with safe_open(str(export.file(manifest.weights)), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            tensor = f.get_slice(key)
            shape = tensor.get_shape()
            size = itemsize.get(tensor.get_dtype(), 4) * math.prod(shape)
            if key.startswith("embed."):
                if manifest.spec.tie_word_embeddings and key.startswith("embed.tokens."):
                    total += size  # the whole table, as the final head's unembedding
                size //= shape[0]  # one row of the table per token
            if not key.startswith("exits."):
                total += size
    return total
