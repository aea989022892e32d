"""The service API and paradecode-generate: streaming, statistics, JSON, threads, and the import boundary."""

import json
import re
import subprocess
import sys
import threading

import pytest

from paradecode.graphs.errors import PromptTooLongError
from paradecode.runtime import GenerationConfig, cli, load


def test_stream_yields_tokens_as_verified_and_ends_with_the_result(exports):
    folder, _ = exports["qwen2"]
    with load(folder) as model:
        stream = model.stream(prompt_ids=[4, 5, 6], max_new_tokens=15, thresholds=0.0, overlap="both", ignore_eos=True)
        seen = [piece.token for piece in stream]
        assert stream.result.token_ids == seen and len(seen) == 15
        whole = model.generate(prompt_ids=[4, 5, 6], max_new_tokens=15, mode="ar", ignore_eos=True)
        assert whole.token_ids == seen


def test_statistics(exports):
    folder, _ = exports["llama"]
    with load(folder) as model:
        result = model.generate(
            prompt_ids=[1, 2, 3],
            config=GenerationConfig(max_new_tokens=20, thresholds=0.0, overlap="streams", ignore_eos=True),
        )
        exit_layers = model.manifest.exit_layers
    stats = result.stats
    assert stats.mode == "paradecode" and stats.overlap == "streams"
    assert stats.new_tokens == 20 and stats.prompt_tokens == 3 and stats.tokens_per_second > 0
    assert stats.exits_per_layer and set(stats.exits_per_layer) <= set(exit_layers)
    assert sum(stats.accepted_per_layer.values()) + stats.rollbacks <= sum(stats.exits_per_layer.values())
    assert stats.lane_busy_seconds["main"] > 0 and stats.calls > 20
    assert stats.stop_reason == "max_new_tokens"
    assert len(result.margins) == 20


@pytest.mark.slow
def test_text_in_and_out_and_eos(stories_export):
    with load(stories_export[0]) as model:
        result = model.generate("Once upon a time", max_new_tokens=250, thresholds=0.5)
        assert result.text and result.text.startswith(",")
        assert result.stats.stop_reason in ("eos", "max_new_tokens", "max_seq_len")
        if result.stats.stop_reason == "eos":
            assert result.token_ids[-1] == 2
        stopped = model.generate("Once upon a time", max_new_tokens=100, stop=("Lily",))
        assert stopped.stats.stop_reason == "stop_string" and "Lily" in stopped.text
        text = "Once upon a time"  # 16 bytes: a server's bound on a text refuses it before tokenizing
        assert model.prompt_ids(text, max_text_bytes=16) == model.prompt_ids(text) == model.tokenizer.encode(text)
        with pytest.raises(PromptTooLongError, match="the prompt has 16 bytes of text.* at most 15 bytes"):
            model.prompt_ids(text, max_text_bytes=15)


def test_calls_from_several_threads_are_serialised_and_correct(exports):
    folder, _ = exports["mistral"]
    with load(folder) as model:
        expected = {
            seed: model.generate(prompt_ids=[seed, 2, 3], max_new_tokens=12, mode="ar", ignore_eos=True).token_ids
            for seed in range(4)
        }
        results, errors = {}, []

        def work(seed):
            try:
                results[seed] = model.generate(
                    prompt_ids=[seed, 2, 3], max_new_tokens=12, thresholds=0.0, overlap="both", ignore_eos=True
                ).token_ids
            except Exception as err:  # collected and reported below
                errors.append(err)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors and results == expected


def test_generate_adaptive_flag(stories_export, capsys):
    """--adaptive on with forced exits (threshold 0, no trained heads: nearly every exit rolled back) passes exits
    up; off never does; both give ar's tokens."""
    folder = str(stories_export[0])
    common = [folder, "--prompt-ids", "1", "--max-new-tokens", "80", "--json", "--ignore-eos", "--threshold", "0"]
    runs = {}
    for flag in ("on", "off"):
        assert cli.main([*common, "--overlap", "batched", "--adaptive", flag]) == 0
        runs[flag] = json.loads(capsys.readouterr().out)
    assert cli.main([*common, "--mode", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert runs["on"]["token_ids"] == runs["off"]["token_ids"] == ar["token_ids"]
    assert runs["on"]["stats"]["exits_skipped"] > 0 and runs["off"]["stats"]["exits_skipped"] == 0, runs


def test_generate_json_prints_new_tokens_text_and_stats(exports, capsys):
    folder, _ = exports["gpt2"]
    assert (
        cli.main(
            [
                str(folder),
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "7",
                "--json",
                "--ignore-eos",
                "--threshold",
                "0",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert len(data["token_ids"]) == 7 and data["text"] is None
    for key in ("tokens_per_second", "exits_per_layer", "rollbacks", "accepted_per_layer", "lane_busy_seconds"):
        assert key in data["stats"]


def test_generate_draft_tokens_flag(exports, stories_export, capsys):
    """--draft-tokens proposes from the export's draft head (its count printed), with plain decoding's tokens; on an
    export without one it is refused with how to re-export."""
    folder = str(exports["qwen3"][0])
    common = [folder, "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--ignore-eos", "--lookup", "0"]
    assert cli.main([*common, "--draft-tokens", "3", "--threshold", "never"]) == 0
    err = capsys.readouterr().err  # the statistics line
    assert re.search(r"lookup: 0 of 0 accepted, draft head: \d+ of [1-9]\d*, rollbacks", err), err
    assert cli.main([*common, "--draft-tokens", "3", "--threshold", "never", "--json"]) == 0
    draft = json.loads(capsys.readouterr().out)
    assert cli.main([*common, "--mode", "ar", "--json"]) == 0
    assert draft["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert draft["stats"]["draft_proposed"] > 0
    assert cli.main([str(stories_export[0]), "--prompt-ids", "1", "--draft-tokens", "2"]) == 2
    assert "has none: re-export the model with `paradecode-export --draft-head FILE`" in capsys.readouterr().err


def test_generate_cli_errors(exports, capsys, tmp_path):
    folder, _ = exports["gpt2"]
    assert cli.main([str(folder), "--prompt-ids", "1", "--threshold", "2"]) == 2
    assert "outside [0, 1]" in capsys.readouterr().err
    assert cli.main([str(folder), "--prompt", "hello"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert cli.main([str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "manifest.json" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "inf"], r"--temperature: expected a number in \[0, 2\]"),
        (["--temperature", "nan"], r"--temperature: expected a number in \[0, 2\]"),
        (["--temperature", "2.5"], r"cap is 2\), got 2.5"),
        (["--temperature", "-1"], r"expected a number in \[0, 2\]"),
    ],
)
def test_generate_refuses_temperatures_the_server_refuses(exports, capsys, flags, message):
    import re

    folder, _ = exports["gpt2"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(folder), "--prompt-ids", "1", *flags])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp, "is a folder; expected a text file"),
        (lambda tmp: tmp / "missing.txt", "missing.txt: no such file"),
        (lambda tmp: "/dev/zero", "holds more than 16 MiB (a device such as /dev/zero never ends)"),
        (lambda tmp: (tmp / "binary.txt").write_bytes(b"\xff\xfe\x00") and tmp / "binary.txt", "is not UTF-8 text"),
    ],
    ids=["folder", "missing", "dev-zero", "binary"],
)
def test_generate_prompt_file_errors(served_export, tmp_path, capsys, make, message):
    code = cli.main([str(served_export), "--prompt-file", str(make(tmp_path)), "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.slow
def test_runtime_never_imports_transformers_or_the_exporter(exports):
    folder, _ = exports["llama"]
    code = (
        "import sys\n"
        "for blocked in ('transformers', 'paradecode.export'):\n"
        "    sys.modules[blocked] = None  # importing it would now fail\n"
        "from paradecode.runtime import load\n"
        f"model = load({str(folder)!r})\n"
        "print(len(model.generate(prompt_ids=[1, 2], max_new_tokens=5, thresholds=0.0, ignore_eos=True).token_ids))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('tensorrt', 'transformers')) and sys.modules[m]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "5" and out[1] == "[]"
