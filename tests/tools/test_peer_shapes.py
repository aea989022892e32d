"""tools/lab/peer_shapes.py's arithmetic, report and fallbacks, on fake modes and a fake transformers model: not
timings (tools/gpu_measure.sh peers runs it, DEVICE=cpu included)."""

import types

import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.tools import harness
from tests.tools.lab import lab_script

peer_shapes = lab_script("peer_shapes")
CASES, HfStatic, Settings = peer_shapes.CASES, peer_shapes.HfStatic, peer_shapes.Settings


def test_the_bounds_are_weight_bytes_over_the_measured_rates():
    limits = peer_shapes.bounds(500_000_000, copy_rate=1.5e12, read_rates={"sum": 3.0e12, "matvec": 2.5e12})
    assert limits["copy_tokens_per_second"] == pytest.approx(3000.0)
    assert limits["read_tokens_per_second"] == pytest.approx(6000.0)  # the faster read
    assert limits["copy_gb_s"] == pytest.approx(1500.0) and limits["read_gb_s"] == {"sum": 3000.0, "matvec": 2500.0}
    with pytest.raises(ValueError, match="positive"):
        peer_shapes.bound(1e12, 0)


def fake(name, kind, rates):
    """A mode whose r-th run (warm-up included) gives rates[r] tokens/s and 4 tokens, 2 of them from lookup."""
    count = {"n": 0}

    def run(prompt_ids, max_new_tokens):
        rate = rates[min(count["n"], len(rates) - 1)]
        count["n"] += 1
        return harness.Sample(token_ids=[1, 2, 3, 4], tokens_per_second=rate, lookup_proposed=3, lookup_accepted=2)

    return harness.Mode(name, kind, run)


def test_a_mode_row_has_median_min_max_the_ratio_to_hf_static_and_the_shares_of_both_bounds():
    modes = [fake("hf static", "hf", [1.0, 100.0, 120.0, 80.0]), fake("ar", "ar", [1.0, 200.0, 180.0, 240.0])]
    results = harness.measure(modes, [[1, 2]], max_new_tokens=4, repeat=3)
    limits = peer_shapes.bounds(1_000_000, copy_rate=4e8, read_rates={"sum": 8e8})  # 400 and 800 tokens/s
    row = peer_shapes.mode_row(results, "ar", "hf static", limits)
    assert row["tokens_per_second"] == {"median": 200.0, "min": 180.0, "max": 240.0}
    assert row["vs_hf_static"] == {"median": 2.0, "min": 1.5, "max": 3.0}  # per repeat: 200/100, 180/120, 240/80
    assert row["share_of_copy_bound"] == pytest.approx(0.5) and row["share_of_read_bound"] == pytest.approx(0.25)
    assert row["new_tokens"] == [4, 4, 4] and (row["lookup_proposed"], row["lookup_accepted"]) == (9, 6)

    payload = {
        "case": "tiny",
        "shape": {"hidden": 8},
        "dtype": "float32",
        "device": "cpu",
        "bounds": limits,
        "modes": {"ar": {**row, "first_generate_seconds": 12.5}},
        "notes": ["a note"],
    }
    text = peer_shapes.table(payload)
    assert "copy bound 400.0 tokens/s" in text and "read bound 800.0 tokens/s" in text
    assert "| ar | 200.0 (180.0-240.0) | 2.00x (1.50-3.00) | 50% | 25% | 12.5 |" in text
    assert text.endswith("a note")


class FakeHf:
    """transformers' generate as far as HfStatic uses it; raises where asked to compile, if `compile_fails`."""

    def __init__(self, compile_fails: bool):
        self.generation_config = types.SimpleNamespace(eos_token_id=2)
        self.compile_fails = compile_fails
        self.calls = []

    def generate(self, input_ids, max_new_tokens, **kwargs):
        import torch

        self.calls.append(kwargs)
        if self.compile_fails and not kwargs.get("disable_compile"):
            raise RuntimeError("InductorError: no compiler\nmore lines")
        new = torch.full((1, max_new_tokens), 7)
        return torch.cat([input_ids, new], dim=1)


def test_hf_static_decodes_every_token_asked_with_its_static_cache():
    model = FakeHf(compile_fails=False)
    hf = HfStatic(model, "cpu", "auto")
    assert model.generation_config.eos_token_id is None
    assert hf([1, 2, 3], 4) == [7, 7, 7, 7]
    assert model.calls[0]["cache_implementation"] == "static" and model.calls[0]["do_sample"] is False
    assert "disable_compile" not in model.calls[0] and "compile_config" not in model.calls[0]  # transformers decides
    assert HfStatic(FakeHf(False), "cpu", "on").options()["compile_config"]._compile_all_devices is True
    assert HfStatic(FakeHf(False), "cpu", "off").options() == {"disable_compile": True}


def test_hf_static_falls_back_to_no_compilation_where_compiling_fails_and_says_so():
    model = FakeHf(compile_fails=True)
    hf = HfStatic(model, "cpu", "on")
    seconds = hf.first([1, 2], 3)
    assert seconds >= 0 and not hf.compiled and hf.compile == "off"
    assert hf.note.startswith("compiling failed (RuntimeError: InductorError: no compiler)")
    assert model.calls[-1] == {**model.calls[-1], "disable_compile": True}
    broken = types.SimpleNamespace(generate=_raises, generation_config=types.SimpleNamespace(eos_token_id=2))
    with pytest.raises(RuntimeError, match="broken"):  # uncompiled already: nothing to fall back to
        HfStatic(broken, "cpu", "off").first([1], 2)


def _raises(*args, **kwargs):
    raise RuntimeError("broken")


def test_settings_and_cases():
    with pytest.raises(UserInputError, match="--repeat 0"):
        Settings(repeat=0)
    with pytest.raises(UserInputError, match="--hf-compile 'maybe'"):
        Settings(hf_compile="maybe")
    for shape, dtype in CASES.values():
        assert (
            shape.hidden % shape.heads == 0 and shape.heads % shape.kv_heads == 0 and dtype in ("float32", "bfloat16")
        )
    config = CASES["1b-bf16"][0].config()
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (2048, 16, 128256)


@pytest.mark.slow
def test_a_tiny_case_end_to_end_on_the_cpu(tmp_path):
    """Prepare (build, save, export), then measure from what was prepared: every mode decodes every token asked,
    ParaDecode's defaults give ar's tokens, and the report has both bounds."""
    shape = peer_shapes.LlamaShape(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, vocab=256)
    assert peer_shapes.prepare("tiny", shape, "float32", 8, tmp_path) > 0
    assert peer_shapes.prepare("tiny", shape, "float32", 8, tmp_path) is None  # already there
    settings = Settings(device="cpu", repeat=1, max_new_tokens=8, hf_compile="off")
    payload = peer_shapes.measure_case("tiny", shape, "float32", settings, tmp_path)
    assert payload["prepare_seconds"] is None and payload["paradecode_defaults_same_tokens_as_ar"]
    assert set(payload["modes"]) == {"hf static", "ar", "paradecode defaults"}
    for row in payload["modes"].values():
        assert row["new_tokens"] == [8] and row["tokens_per_second"]["median"] > 0
        assert row["share_of_copy_bound"] > 0 and row["share_of_read_bound"] > 0
    assert payload["hf_static"] == {"compiled": False, "note": "", "compile_option": "off"}
    assert "| paradecode defaults |" in peer_shapes.table(payload)
