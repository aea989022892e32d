"""The soak's verdicts (tools/lab/soak.py): which answers must agree, what counts as lost, and the memory's growth
between the second and the last quarter."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from tests.tools.lab import lab_script

soak = lab_script("soak")
Job, Outcome, Soak = soak.Job, soak.Outcome, soak.Soak


def soak_of(outcomes: list, rss: list | None = None) -> object:
    state = Soak(exports={}, flags=[], out=Path("."), seconds=400.0)
    state.outcomes, state.rss = outcomes, rss or []
    return state


def done(job, text: str, status: str = "completed") -> object:
    return Outcome(job, started=0.0, status=status, text=text, finish_reason="length")


def test_greedy_answers_must_agree_across_servers_and_seeded_ones_within_a_server():
    greedy_pd, greedy_ar = (Job(t, "chat", 1, None, None) for t in ("paradecode", "ar"))
    seeded_pd, seeded_ar = (Job(t, "chat", 1, 2, None) for t in ("paradecode", "ar"))
    agreeing = soak_of([done(greedy_pd, "a"), done(greedy_ar, "a"), done(seeded_pd, "x"), done(seeded_ar, "y")])
    summary = agreeing.summary()
    assert summary["differing_answer_keys"] == {}  # seeded: each server's own stream of draws
    assert summary["repeated_answer_keys"] == 1 and summary["repeated_requests"] == 2

    differing = soak_of([done(greedy_pd, "a"), done(greedy_ar, "b"), done(seeded_pd, "x"), done(seeded_pd, "z")])
    keys = differing.summary()["differing_answer_keys"]
    assert set(keys) == {greedy_pd.answer_key(), seeded_pd.answer_key()}
    assert sorted(entry["text"] for entry in keys[greedy_pd.answer_key()]) == ["a", "b"]


def test_dropped_and_refused_requests_are_neither_compared_nor_lost():
    job = Job("ar", "completions", 0, None, None)
    state = soak_of(
        [
            done(job, "whole"),
            done(Job("ar", "completions", 0, None, 1), "wh", status="dropped"),
            Outcome(job, started=0.0, status="refused", reason="503 export_changed"),
            Outcome(job, started=0.0, status="lost", reason="RemoteProtocolError: peer closed connection"),
        ]
    )
    summary = state.summary()
    assert summary["differing_answer_keys"] == {} and summary["repeated_answer_keys"] == 0
    assert summary["by_status"] == {"completed": 1, "dropped": 1, "refused": 1, "lost": 1}
    assert summary["refused_by_reason"] == {"503 export_changed": 1}
    assert [lost["reason"] for lost in summary["lost"]] == ["RemoteProtocolError: peer closed connection"]


def test_memory_growth_compares_the_second_and_last_quarters_floor_median_and_peak():
    # 400 s: quarters [0, 100), [100, 200), [200, 300), [300, 400); the first quarter's restart is left out
    # (a server of 900 MB restarted at 30 s; then 700 MB, every 10th sample a peak of 1,000 MB, and from 300 s on
    # 770 MB with peaks of 1,010 MB)
    def mb(t: int) -> float:
        return 900.0 if t < 30 else (1000.0 + 10 * (t >= 300) if t % 20 == 0 else 700.0 + 70 * (t >= 300))

    rss = [(t, "paradecode", 1 + (t >= 30), mb(t)) for t in range(0, 400, 2)]
    summary = soak_of([], rss).summary()
    memory = summary["memory"]
    assert memory["paradecode"]["min_mb_by_quarter"] == [700.0, 700.0, 700.0, 770.0]
    assert memory["paradecode"]["max_mb_by_quarter"] == [1000.0, 1000.0, 1000.0, 1010.0]
    growth = memory["paradecode"]["growth_q2_to_q4"]
    assert growth["min"] == pytest.approx(0.10) and growth["max"] == pytest.approx(0.01)
    assert growth["median"] == pytest.approx(0.10)
    assert memory["ar"]["growth_q2_to_q4"] == {"min": None, "median": None, "max": None}  # no samples: no verdict
    assert len(summary["rss_samples"]) == 200 and summary["rss_samples"][0] == [0, "paradecode", 1, 900.0]


def test_the_mix_has_every_kind_of_request():
    rng = random.Random(3)
    jobs = [soak.job_of(rng) for _ in range(2000)]
    kinds = Counter((j.target, j.long, j.seed is None, j.drop_after is None, j.endpoint) for j in jobs)
    assert {j.target for j in jobs} == set(soak.TARGETS)
    assert 0.05 < sum(j.long for j in jobs) / len(jobs) < 0.15
    assert 0.3 < sum(j.seed is not None for j in jobs) / len(jobs) < 0.5
    assert {j.drop_after for j in jobs} == {None, 0, 1, 4}
    assert all(j.endpoint == "completions" for j in jobs if j.long)  # long prompts as text
    assert len(kinds) >= 20
    long_body = Job("ar", "completions", len(soak.SHORT), 3, None).body("m")
    assert long_body["temperature"] == soak.TEMPERATURE and long_body["seed"] == 3
    assert Job("ar", "chat", 0, None, None).body("m")["messages"][0]["content"] == soak.SHORT[0]
