"""Benchmark, profile and characterisation tools: their outputs' formats and arithmetic, not timings."""

import json

import pytest

from paradecode.runtime.lanes import Span
from paradecode.tools import bench, characterise, profiler


@pytest.fixture(scope="module")
def stories_export(stories_dir, tmp_path_factory):
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path_factory.mktemp("tools") / "stories"
    export_model(ExportConfig(model=str(stories_dir / "hf"), output=out, max_seq_len=128))
    return out


def test_bench_writes_table_json_and_png(stories_export, stories_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe dog\n")
    code = bench.main(
        [
            str(stories_export),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--repeat",
            "2",
            "--thresholds",
            "default,never",
            "--overlaps",
            "batched,both",
            "--hf",
            str(stories_dir / "hf"),
            "--json",
            str(tmp_path / "b.json"),
            "--plot",
            str(tmp_path / "b.png"),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| mode | tok/s |" in table and "paradecode batched default" in table and "| hf |" in table
    data = json.loads((tmp_path / "b.json").read_text())
    summary = data["summary"]
    assert summary["_baseline"]["ar"].startswith("ar (") and summary["_baseline"]["hf"] == "hf"
    for name in ("paradecode batched default", "paradecode both never", "hf"):
        row = summary[name]
        for key in (
            "tokens_per_second",
            "latency_ms_p50",
            "latency_ms_p95",
            "speedup_vs_ar",
            "speedup_vs_hf",
            "exact_match_vs_ar",
        ):
            assert key in row, (name, key)
        assert row["exact_match_vs_ar"] == 1.0, name  # every mode gives the same tokens
        assert set(row["speedup_vs_ar"]) == {"min", "median", "max"}
    assert "exits_per_layer" in summary["paradecode batched default"]
    assert len(data["samples"]) == 2 * 2 * (len(summary) - 1 - sum("skipped" in r for r in summary.values()))
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp")), "a temporary file was left behind"


def test_bench_refuses_bad_input(stories_export, tmp_path, capsys):
    assert bench.main([str(stories_export), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert bench.main([str(stories_export), "--thresholds", "1.5"]) == 2


def test_profile_trace_format_and_lane_overlap(stories_export, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert (
        profiler.main(
            [
                str(stories_export),
                "--prompt",
                "Once upon a time",
                "--max-new-tokens",
                "24",
                "--overlap",
                "streams",
                "--threshold",
                "0",
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    report = capsys.readouterr().out
    assert "lane main" in report and "lane side1" in report
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"lane main", "lane side1", "lane phases"} <= names
    calls = [e for e in events if e["ph"] == "X" and e["cat"] == "subgraph"]
    assert {"embed", "final"} <= {e["name"] for e in calls} and any(e["name"].startswith("layer_") for e in calls)
    phases = {e["name"] for e in events if e["ph"] == "X" and e["cat"] == "phase"}
    assert {"prefill", "verify"} <= phases
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in calls)
    assert data["otherData"]["stats"]["mode"] == "paradecode"
    assert trace.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_overlap_arithmetic():
    spans = [
        Span("a", "x", 0.0, 1.0, (0, 1)),
        Span("a", "x", 2.0, 3.0, (0, 1)),
        Span("b", "y", 0.5, 2.5, (0, 1)),
        Span("b", "y", 2.6, 2.7, (0, 1)),
    ]
    assert profiler.overlap_seconds(spans, "a", "b") == pytest.approx(0.5 + 0.5 + 0.1)
    assert profiler.lane_busy(spans)[0] == ("b", pytest.approx(2.1))


def test_bounds_match_design():
    layers, e, k = 8, 2, 6
    b = characterise.bounds(0.0, e, layers, k)
    assert b == {"streams": 1.0, "batched": 1.0, "both": 1.0}
    b = characterise.bounds(1.0, e, layers, k)
    assert b["streams"] == pytest.approx(8 / 6) and b["batched"] == pytest.approx(8 / 3) and b["both"] == 4.0
    assert characterise.bounds(0.5, 4, 8, 6)["streams"] == pytest.approx(8 / 6)


def test_characterise_runs_with_parity(tmp_path, capsys):
    assert (
        characterise.main(
            [
                "--hidden",
                "64",
                "--ffn",
                "128",
                "--layers",
                "4",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--vocab",
                "128",
                "--acceptance",
                "0,1",
                "--depths",
                "0.5",
                "--repeat",
                "1",
                "--max-new-tokens",
                "16",
                "--overlaps",
                "batched,streams",
                "--json",
                str(tmp_path / "c.json"),
                "--plot",
                str(tmp_path / "c.png"),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "c.json").read_text())
    full = [r for r in data["results"] if r["acceptance"] == 1.0]
    assert all(r["exit_share"] > 0.5 for r in full), full  # the oracle made most tokens exit (K caps the rest)
    assert all(r["exit_share"] == 0.0 for r in data["results"] if r["acceptance"] == 0.0)
    assert (tmp_path / "c.png").is_file()
