"""runtime/policy.py: every machine-dependent default is a row that cites existing measurements, and what the runtime
reads agrees with the rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from paradecode.runtime import policy
from paradecode.runtime.config import GenerationConfig

RESULTS = Path(__file__).resolve().parents[2] / "tools" / "results"


@pytest.mark.parametrize("row", policy.DEFAULTS, ids=lambda row: f"{row.setting}: {row.where}")
def test_every_default_cites_results_that_exist(row):
    assert row.evidence and row.why
    missing = [path for path in row.evidence if not (RESULTS / path).is_file()]
    assert not missing, f"{row.setting} ({row.where}) cites {missing}, which tools/results/ does not hold"


def rows(setting: str) -> dict[str, str]:
    return {row.where: row.value for row in policy.DEFAULTS if row.setting == setting}


def test_the_overlap_auto_means_is_its_rows():
    assert {device: policy.auto_overlap(device) for device in ("cpu", "cuda")} == rows("overlap auto")


def test_paradecode_with_every_position_alone_is_its_row():
    assert rows("ParaDecode, every position alone") == {"batched": "plain decoding"}
    assert policy.decodes_plainly(True, "batched")
    assert not policy.decodes_plainly(True, "streams") and not policy.decodes_plainly(False, "batched")


def test_threads_per_call_are_their_row():
    assert rows("onnxruntime threads per call") == {"cpu": "every core"}
    assert policy.onnxruntime_threads(4) == 4


def test_asking_the_draft_head_adapts_greedy_decoding_on_a_cpu_whether_lookup_is_on_or_not():
    for lookup in (0, 5):
        assert policy.adapts("cpu", "batched", 0.0, lookup, 3)
        assert GenerationConfig(lookup_tokens=lookup, draft_tokens=1).adapts("cpu")
    assert not policy.adapts("cpu", "batched", 0.7, 5, 3) and not policy.adapts("cuda", "batched", 0.0, 5, 3)
    assert not GenerationConfig(draft_tokens=3, thresholds=0.5).adapts("cpu")  # explicit thresholds: as given


@pytest.mark.parametrize(
    ("device", "temperature", "lookup", "skips", "adapts"),
    [
        ("cpu", 0.0, 5, True, False),  # lookup on: lookup alone, not adapting
        ("cpu", 0.7, 0, True, False),  # sampling
        ("cuda", 0.0, 0, True, False),
        ("cpu", 0.0, 0, False, True),  # greedy exits alone on a CPU adapt
    ],
)
def test_exits_and_adaptation_follow_their_rows(device, temperature, lookup, skips, adapts):
    assert policy.skips_exits(device, "batched", temperature, lookup) is skips
    assert policy.adapts(device, "batched", temperature, lookup) is adapts
    config = GenerationConfig(temperature=temperature, lookup_tokens=lookup)
    assert config.skips_exits(device, "batched") is skips and config.adapts(device, "batched") is adapts
    assert not policy.skips_exits(device, "streams", temperature, lookup)  # rows measured in batched only
    explicit = GenerationConfig(temperature=temperature, lookup_tokens=lookup, thresholds=0.5)
    assert not explicit.skips_exits(device, "batched") and not explicit.adapts(device, "batched")
