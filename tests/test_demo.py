"""paradecode-demo, the README's main command, end to end on the project's small demo model."""

import pytest

from paradecode.tools import demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_demo_exports_streams_and_compares_with_ar(tmp_path, capsys):
    code = demo.main(["--model", "demo", "-o", str(tmp_path / "demo"), "--max-new-tokens", "12", "--repeat", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):")  # the streamed answer continues the prompt
    assert "speedup over ar" in out and "tokens/s (median)" in out
    assert "output identical to ar token for token: 4/4 runs (yes)" in out


def test_every_showcase_names_its_model_and_prompts():
    for name, show in demo.SHOWCASES.items():
        assert show.prompts and show.max_seq_len > 0, name
        assert show.heads is None or show.heads.name.endswith(".safetensors"), name
