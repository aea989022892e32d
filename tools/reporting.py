"""Benchmark and trace reports: a Markdown table, JSON and PNG files, each written atomically."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import MissingDependencyError

logger = logging.getLogger(__name__)


def write_atomically(path: Path, data: bytes | str) -> Path:
    """Write to a temporary name beside `path`, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_json(path: Path, payload: dict[str, Any]) -> Path:
    return write_atomically(path, json.dumps(payload, indent=2, default=str) + "\n")


def check_outputs(outputs: dict[str, Path | None]) -> None:
    """Refuse before a long run the output files (by option: {"--json": path}; None where not given) that its end
    could not write: a folder, a path under a file, an unwritable folder, a device (`check_file_writable`)."""
    from paradecode.export.files import check_file_writable

    for option, path in outputs.items():
        if path is not None:
            check_file_writable(path, option)


def save_outputs(outputs: list[tuple[str, Path, Callable[[Path], object]]]) -> list[str]:
    """Write a run's output files at its end, each (option, path, save) as save(path); returns a message for each
    that could not be written, so that the caller prints the run's summary all the same and then says what was lost.

    The paths were checked before the run (`check_outputs`); what fails here changed since (its folder was removed
    or became read-only) or ran out of space. One failure does not stop the next output.
    """
    unwritten = []
    for option, path, save in outputs:
        try:
            save(path)
        except OSError as err:
            unwritten.append(
                f"{option} {path} could not be written ({err.strerror or err}); the summary above is the run's "
                "result. Check the folder and the free space before the next run."
            )
        else:
            logger.info("wrote %s", path)
    return unwritten


def check_plotting() -> None:
    """Refuse at once a --plot that the end of a long run could not draw (matplotlib missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(f"--plot needs matplotlib: `pip install paradecode[bench]` ({err}).") from err


def save_figure(path: Path, figure) -> Path:
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return write_atomically(path, buffer.getvalue())


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_report(summary: dict[str, dict[str, Any]], by_category: dict[str, dict[str, Any]]) -> str:
    """bench's table for all prompts, then, where the prompts have categories, one table per category."""
    if not by_category:
        return markdown_table(summary)
    total = sum(len(group["prompts"]) for group in by_category.values())
    parts = [f"## all prompts ({total})", "", markdown_table(summary)]
    for name, group in by_category.items():
        count = len(group["prompts"])
        heading = f"## {name} ({count} prompt{'' if count == 1 else 's'})"
        parts += ["", heading, "", markdown_table(group["summary"], note=False)]
    return "\n".join(parts)


def markdown_table(summary: dict[str, dict[str, Any]], *, note: bool = True) -> str:
    """One row per mode; `note`: begin with the line that says what the speedups are against."""
    baseline = summary.get("_baseline", {})
    against = f"`{baseline.get('ar')}` (plain decoding, same export and backend)"
    if baseline.get("hf"):
        against += f" and `{baseline['hf']}` (Hugging Face generate)"
    lines = (
        [
            f"speedups are medians over repeats (min-max) against {against}; match ar: the share of runs whose "
            "tokens are exactly ar's (in brackets, the share of identical leading tokens)",
            "",
        ]
        if note
        else []
    )
    lines += [
        "| mode | tok/s | p50 ms | p95 ms | vs ar | vs HF | exits per layer (accepted) | lookup (accepted) | "
        "draft head (accepted) | rollback rate | match ar (leading) | peak MB |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for name, row in summary.items():
        if name.startswith("_"):
            continue
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | | | | | | | | |")
            continue

        def speedup(key: str, row=row) -> str:
            s = row.get(key)
            return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})" if s else "-"

        exits = row.get("exits_per_layer")
        exit_text = (
            ", ".join(f"{k}: {v} ({row['accepted_per_layer'].get(k, 0)})" for k, v in exits.items()) if exits else "-"
        )
        lookup_text = f"{row['lookup_proposed']} ({row['lookup_accepted']})" if row.get("lookup_proposed") else "-"
        draft_text = f"{row['draft_proposed']} ({row['draft_accepted']})" if row.get("draft_proposed") else "-"
        bound_text = f"; bound {row['bound_vs_ar']:.2f}x" if "bound_vs_ar" in row else ""
        leading = row.get("leading_match_vs_ar")
        match_text = f"{row['exact_match_vs_ar']:.0%}" + (f" ({leading:.0%})" if leading is not None else "")
        lines.append(
            f"| {name} | {_fmt(row['tokens_per_second'])} | {_fmt(row['latency_ms_p50'], 2)} | "
            f"{_fmt(row['latency_ms_p95'], 2)} | {speedup('speedup_vs_ar')}{bound_text} | {speedup('speedup_vs_hf')} | "
            f"{exit_text} | {lookup_text} | {draft_text} | "
            f"{_fmt(row.get('rollback_rate'), 2)} | {match_text} | {_fmt(row['peak_rss_mb'])} |"
        )
    return "\n".join(lines)


def benchmark_figure(summary: dict[str, dict[str, Any]], title: str):
    """Left: speedup over ar against the threshold, per overlap, with the other runtimes' (peers') speedups as
    horizontal lines; right: early exits per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves: dict[str, list[tuple[float, dict]]] = {}
    for name, row in summary.items():
        if name.startswith("_") or row.get("kind") != "paradecode" or "speedup_vs_ar" not in row:
            continue
        settings = row["settings"]
        threshold = settings.get("thresholds")
        x = -0.05 if threshold is None else (1.05 if threshold == float("inf") else float(threshold))
        curves.setdefault(settings.get("overlap", "?"), []).append((x, row["speedup_vs_ar"]))
    for overlap, points in sorted(curves.items()):
        points.sort(key=lambda p: p[0])
        xs = [p[0] for p in points]
        med = [p[1]["median"] for p in points]
        err = [[m - p[1]["min"] for m, p in zip(med, points)], [p[1]["max"] - m for m, p in zip(med, points)]]
        left.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=overlap)
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    peers = [(n, r) for n, r in summary.items() if r.get("kind") == "peer" and "speedup_vs_ar" in r]
    for (name, row), color in zip(peers, ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")):
        speedup = row["speedup_vs_ar"]
        left.axhspan(speedup["min"], speedup["max"], color=color, alpha=0.12, lw=0)
        left.axhline(speedup["median"], color=color, lw=1.2, ls=":", label=name)
    left.set_xlim(-0.15, 1.15)
    left.set_xlabel("threshold (-0.05: the export's default thresholds; 1.05: never exit)")
    left.set_ylabel("speedup over ar (median, min-max over repeats)")
    left.set_title("ParaDecode speedup vs threshold")
    left.legend()
    names = [n for n, r in summary.items() if not n.startswith("_") and r.get("exits_per_layer")]
    layers = sorted({int(k) for n in names for k in summary[n]["exits_per_layer"]})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        row = summary[name]
        xs = [layer + (i - (len(names) - 1) / 2) * width for layer in layers]
        right.bar(xs, [row["exits_per_layer"].get(str(layer), 0) for layer in layers], width, alpha=0.35)
        right.bar(xs, [row["accepted_per_layer"].get(str(layer), 0) for layer in layers], width, label=name)
    right.set_xticks(layers)
    right.set_xlabel("exit layer")
    right.set_ylabel("early tokens (light: proposed, solid: accepted)")
    right.set_title("Early exits per layer")
    if names:
        right.legend(fontsize=7)
    figure.suptitle(title)
    return figure
