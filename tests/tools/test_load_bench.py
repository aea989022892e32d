"""paradecode-loadtest: a small load run against real servers in subprocesses, and its argument checks."""

import json
import os

import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.tools import load_bench
from paradecode.tools.load_client import LoadSettings, Record, request_of


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_run_against_paradecode_and_ar(stories_export, tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = [str(stories_export[0]), "--requests", "8", "--concurrency", "1,4", "--modes", "paradecode,ar"]
    argv += ["--max-tokens", "8", "--replicas", "1", "--ignore-eos", "--rounds", "2", "--json", str(out)]
    assert load_bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "| clients | server | requests | errors | TTFT p50 |" in table and "paradecode tokens/s over ar: " in table
    assert "| 1 | paradecode | 8 | 0 |" in table and "| 4 | ar | 8 | 0 |" in table
    data = json.loads(out.read_text())
    assert data["command"].startswith("paradecode-loadtest ") and "cpus" in data["machine"]
    assert set(data["servers"]) == {"paradecode", "ar"}
    assert set(data["levels"]) == {"1", "4"} and data["levels"]["4"] == data["summary"]
    for mode in ("paradecode", "ar"):
        assert data["levels"]["1"][mode]["requests"] == 8
        records = [r for r in data["records"] if r["target"] == mode and r["concurrency"] == 4]
        assert len(records) == 8 and sorted(r["index"] for r in records) == list(range(8))
        assert {r["round"] for r in records} == {0, 1}
        for r in records:
            assert r["error"] is None, r
            assert 0 < r["first_token_seconds"] <= r["latency_seconds"], r
            assert r["completion_tokens"] == 8 and r["tokens_from"] == "usage", r  # --ignore-eos: all 8
            assert r["endpoint"] == "completions" and r["finish_reason"] == "length", r  # no chat template: text
        row = data["summary"][mode]
        assert row["requests"] == 8 and row["errors"] == 0 and row["completion_tokens"] == 64
        assert row["tokens_per_second"] > 0 and row["ttft_ms_p50"] <= row["ttft_ms_p95"]
        assert row["rss_mb_before"] > 0 and row["rss_mb_after"] > 0 and row["rss_mb_growth"] is not None
        assert row["rss_mb_peak"] > 0  # read while the rounds ran
    assert data["paradecode_vs_ar"] > 0
    # greedy on one export: every prompt gets one answer, whatever the server, mode and level
    assert data["answers"]["differing"] == 0 and data["answers"]["prompts"] > 0
    assert all(r["text"] for r in data["records"])
    assert "answers: 0 of " in table


def parse(*flags: str):
    return load_bench.build_parser().parse_args(["DIR", *flags])


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--requests", "0"), "--requests must be an integer of at least 1, got 0"),
        (("--concurrency", "-2"), "--concurrency must be an integer of at least 1, got -2"),
        (
            ("--modes", "paradecode,fast"),
            "--modes 'paradecode,fast': expected comma-separated modes from ar, paradecode; not 'fast'",
        ),
        (("--modes", ","), "--modes ',': expected comma-separated modes"),
        (("--modes", "ar,ar"), "--modes 'ar,ar' names a mode more than once"),
        (("--rounds", "0"), "--rounds must be an integer of at least 1"),
        (("--max-tokens", "0"), "--max-tokens must be an integer of at least 1"),
        (("--replicas", "0"), "--replicas must be at least 1"),
        (("--temperature", "3"), "--temperature must be in [0, 2]"),
        (("--request-timeout", "0"), "--request-timeout must be a positive number"),
        (("--url", "localhost:8000"), "--url 'localhost:8000': expected the server's address"),
        (("--url", "http://127.0.0.1:1", "--modes", "ar"), "--modes set how this tool starts its servers"),
        (("--url", "http://127.0.0.1:1", "--max-batch", "8"), "--max-batch set how this tool starts its servers"),
        (("--concurrency", "1,x"), "--concurrency '1,x': expected comma-separated integers"),
        (("--concurrency", "2,2"), "--concurrency '2,2' names 2 more than once"),
        (("--max-batch", "0"), "--max-batch must be an integer of at least 1, got 0"),
    ],
)
def test_bad_flags_are_named(flags, message):
    with pytest.raises(UserInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_bench.check_args(parse(*flags))


def test_targets_settings_and_requests_from_the_flags(capsys):
    assert load_bench.check_args(parse()) == (["paradecode", "ar"], LoadSettings())
    assert load_bench.check_args(parse("--modes", " ar "))[0] == ["ar"]
    names, settings = load_bench.check_args(parse("--url", "http://127.0.0.1:8000", "--requests", "3", "--ignore-eos"))
    assert names == [load_bench.URL_TARGET] and settings == LoadSettings(requests=3, rounds=3, ignore_eos=True)
    assert LoadSettings(requests=10, rounds=4).edges() == [0, 2, 5, 7, 10]  # every request in one round
    # several levels run lowest first; several batch sizes start a server per mode and size
    levels = parse("--concurrency", "8,1,2", "--max-batch", "8,1", "--modes", "paradecode,ar")
    names, settings = load_bench.check_args(levels)
    assert names == ["paradecode, batch 8", "paradecode, batch 1", "ar, batch 8", "ar, batch 1"]
    assert load_bench.concurrency_levels(levels.concurrency) == [1, 2, 8] and settings.concurrency == 8
    assert load_bench.server_flags("ar, batch 1", levels) == ["--mode", "ar", "--max-batch", "1"]
    assert load_bench.server_flags("ar", parse("--max-batch", "4")) == ["--mode", "ar", "--max-batch", "4"]
    assert load_bench.server_flags("ar", parse()) == ["--mode", "ar"]
    with pytest.raises(UserInputError, match="give DIR"):
        load_bench.check_args(load_bench.build_parser().parse_args([]))
    assert load_bench.main(["--requests", "0"]) == 2
    assert "paradecode-loadtest: error: --requests must be an integer of at least 1, got 0" in capsys.readouterr().err

    endpoint, request = request_of("Once upon", 3, LoadSettings(max_tokens=5))
    assert endpoint == "completions" and request == {
        "prompt": "Once upon",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = [{"role": "user", "content": "Hi"}]
    endpoint, request = request_of(chat, 3, LoadSettings(temperature=0.7, ignore_eos=True))
    assert endpoint == "chat" and request["messages"] == chat
    assert request["temperature"] == 0.7 and request["seed"] == 3 and request["extra_body"] == {"ignore_eos": True}


def test_percentiles_are_measured_values():
    assert load_bench.percentiles_ms([]) == (None, None)
    assert load_bench.percentiles_ms([0.001 * i for i in range(1, 21)]) == pytest.approx((11.0, 19.0))


# --- output files: refused before the load, and a write that fails at the end costs the file, not the summary ------

URL = "http://127.0.0.1:9"  # --url: no server is started; `load` is replaced, so nothing is sent


@pytest.mark.timeout(60)  # refused before the load: a regression would run it first
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (lambda tmp: ["--json", str(tmp)], "--json {tmp} is a folder; give a file name"),
        (lambda tmp: ["--plot", str(tmp / "f.txt" / "plot.png")], "--plot {tmp}/f.txt/plot.png: {tmp}/f.txt is not a"),
        (lambda tmp: ["--json", "/proc/x.json"], "--json /proc/x.json cannot be written: /proc refuses new files"),
        (lambda tmp: ["--json", str(tmp / "fifo")], "--json {tmp}/fifo is not a regular file"),  # /dev/null, safely
    ],
    ids=["json-folder", "plot-under-a-file", "json-in-proc", "json-device"],
)
def test_loadtest_refuses_outputs_it_could_not_write_before_the_load(monkeypatch, tmp_path, capsys, flags, message):
    (tmp_path / "f.txt").write_text("a file")
    os.mkfifo(tmp_path / "fifo")
    loads = []

    async def no_load(*args):
        loads.append(args)
        raise AssertionError("the load ran although an output could not be written")

    monkeypatch.setattr(load_bench, "load", no_load)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert load_bench.main(["--url", URL, "--requests", "2", *flags(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"paradecode-loadtest: error: {message.format(tmp=tmp_path)}" in err and "Traceback" not in err, err
    assert not loads and sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lost", ["--json", "--plot"])
def test_loadtest_prints_its_summary_when_an_output_cannot_be_written_at_the_end(monkeypatch, tmp_path, capsys, lost):
    """The output's folder is missing when the load starts (the writers make it) and a file takes its name during the
    load: the write fails at the end; the table is printed all the same, the other output is written, exit code 1."""
    paths = {"--json": tmp_path / "json" / "load.json", "--plot": tmp_path / "plot" / "load.png"}

    async def load(targets, prompts, settings):
        paths[lost].parent.write_text("took the folder's name during the load")
        for target in targets:
            target.wall_seconds = 0.5
        return [
            Record(
                target=t.name,
                round=0,
                index=0,
                endpoint="completions",
                first_token_seconds=0.05,
                latency_seconds=0.2,
                completion_tokens=4,
            )
            for t in targets
        ]

    monkeypatch.setattr(load_bench, "load", load)
    flags = [text for option, path in paths.items() for text in (option, str(path))]
    assert load_bench.main(["--url", URL, "--requests", "1", "--warmup", "0", *flags]) == 1
    out, err = capsys.readouterr()
    assert "| 8 | server | 1 | 0 |" in out, out  # the summary: concurrency 8 (the default), one request, no error
    assert f"paradecode-loadtest: error: {lost} {paths[lost]} could not be written (" in err, err
    assert "Traceback" not in err
    kept = next(option for option in paths if option != lost)
    assert paths[kept].stat().st_size > 0 and not paths[lost].parent.is_dir()


def test_the_plot_is_drawn_when_no_request_brought_text():
    """Every request failed or came back empty: no TTFT or ITL to put on a log scale, and the figure still draws (it
    raised at the end of the run, after the load)."""
    import io

    empty = {"tokens_per_second": None, **{f"{k}_ms_{p}": None for k in ("ttft", "itl") for p in ("p50", "p95")}}
    figure = load_bench.load_figure({1: {"ar": empty}, 4: {"ar": empty}}, LoadSettings())
    figure.savefig(io.BytesIO(), format="png")


def test_answers_agree_counts_the_prompts_answered_otherwise():
    def record(index: int, text: str, error=None) -> Record:
        return Record(target="ar", round=0, index=index, endpoint="chat", text=text, finish_reason="stop", error=error)

    records = [record(0, "a"), record(3, "a"), record(1, "b"), record(4, "c"), record(2, "d"), record(5, "", "Boom")]
    assert load_bench.answers_agree(records, 3) == {"prompts": 3, "differing": 1, "differing_prompts": [1]}
