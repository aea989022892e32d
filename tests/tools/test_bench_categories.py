"""paradecode-bench and the prompt sets' categories: the default prompts, and results per category."""

from __future__ import annotations

import pytest

from paradecode.export import prompt_sets
from paradecode.export.prompt_files import LabelledPrompt
from paradecode.tools import bench_modes, harness, reporting
from paradecode.tools.bench import default_prompts


def test_bench_defaults_to_eval_where_the_export_has_a_chat_template(monkeypatch):
    monkeypatch.setattr(prompt_sets, "PROMPT_SETS", {"eval": lambda: [LabelledPrompt("evaluation", "code")]})

    class Export:
        chat_template = None

    assert [p.prompt for p in default_prompts(Export())] == list(bench_modes.DEFAULT_PROMPTS)
    Export.chat_template = object()
    assert default_prompts(Export()) == [LabelledPrompt("evaluation", "code")]


# --- results per category ------------------------------------------------------------------------------------------


def fake_mode(name: str, kind: str, rate_of_prompt) -> harness.Mode:
    """A mode whose tokens/s depends on the prompt (its first id), and that exits once per call."""
    return harness.Mode(
        name,
        kind,
        lambda ids, n: harness.Sample(token_ids=[1, 2], tokens_per_second=rate_of_prompt(ids[0]), exits={1: 1}),
    )


def test_bench_results_are_grouped_by_the_prompts_category():
    ar = fake_mode("ar", "ar", lambda p: 10.0)
    fast_on_code = fake_mode("paradecode", "paradecode", lambda p: 30.0 if p in (0, 2) else 12.0)
    results = harness.measure([ar, fast_on_code], [[0], [1], [2], [3]], max_new_tokens=2, repeat=2)
    categories = ["code", "maths", "code", None]
    by_category = bench_modes.summarize_by_category(results, categories)
    assert list(by_category) == ["code", "maths", bench_modes.UNCATEGORISED]
    assert [g["prompts"] for g in by_category.values()] == [[0, 2], [1], [3]]
    code, maths = by_category["code"]["summary"], by_category["maths"]["summary"]
    assert code["paradecode"]["speedup_vs_ar"]["median"] == pytest.approx(3.0)
    assert maths["paradecode"]["speedup_vs_ar"]["median"] == pytest.approx(1.2)
    assert code["paradecode"]["exits_per_layer"] == {"1": 4}  # 2 prompts x 2 repeats: this category's runs only
    assert code["_baseline"]["ar"] == "ar"
    assert bench_modes.summarize_by_category(results, [None] * 4) == {}

    overall = bench_modes.summarize(results)
    report = reporting.markdown_report(overall, by_category)
    assert report.startswith("## all prompts (4)\n")
    for heading in ("## code (2 prompts)", "## maths (1 prompt)", "## uncategorised (1 prompt)"):
        assert heading in report
    assert report.count("| mode | tok/s |") == 4 and report.count("speedups are medians") == 1
    assert reporting.markdown_report(overall, {}) == reporting.markdown_table(overall)


def test_per_category_speedups_are_against_the_overall_baseline():
    """Two ar settings, each faster on a different category: every category is measured against the one baseline."""
    slow = fake_mode("ar slow", "ar", lambda p: 8.0 if p == 0 else 20.0)
    fast = fake_mode("ar fast", "ar", lambda p: 10.0)
    results = harness.measure([slow, fast], [[0], [1], [2]], max_new_tokens=2, repeat=1)
    assert results.baseline == "ar slow"  # median 20 against 10
    by_category = bench_modes.summarize_by_category(results, ["a", "b", "b"])
    assert by_category["a"]["summary"]["_baseline"]["ar"] == "ar slow"
    assert by_category["a"]["summary"]["ar fast"]["speedup_vs_ar"]["median"] == pytest.approx(10 / 8)
