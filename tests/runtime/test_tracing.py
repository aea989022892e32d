"""The one measuring interface of a request, `Tracing`: spans, annotations and an exit policy, none of which changes
the output, and nothing of it by default."""

from __future__ import annotations

import contextlib

import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import Tracing, load

PROMPT = [1, 403, 407, 261, 378]  # a stories260K prompt
SETTINGS = dict(max_new_tokens=24, ignore_eos=True, thresholds=0.0, adaptive=False, lookup_tokens=0)


def test_tracing_records_annotates_and_decides_exits_without_changing_the_output(stories_export):
    names: list[str] = []

    def annotate(name: str):
        names.append(name)
        return contextlib.nullcontext()

    asked: list[tuple[int, int]] = []

    def exit_at_3(position: int, layer: int, out) -> int | None:
        asked.append((position, layer))
        return out.token[0] if layer == 3 else None

    with load(stories_export[0]) as model:
        ar = model.generate(prompt_ids=PROMPT, max_new_tokens=24, ignore_eos=True, mode="ar")
        plain = model.generate(prompt_ids=PROMPT, **SETTINGS)
        tracing = Tracing(spans=True, annotate=annotate, exit_policy=exit_at_3)
        traced = model.generate(prompt_ids=PROMPT, tracing=tracing, **SETTINGS)
        stream = model.stream(prompt_ids=PROMPT, tracing=Tracing(spans=True), **SETTINGS)
        streamed = list(stream)

    assert plain.token_ids == traced.token_ids == ar.token_ids == [t.token for t in streamed]
    assert plain.timeline is None  # nothing recorded unless asked for
    assert len(stream.result.timeline.spans) == stream.result.stats.calls > 0  # a stream records its calls too
    spans = traced.timeline.spans
    calls = [s for s in spans if s.lane != "phases"]
    assert len(calls) == traced.stats.calls > 0
    assert {"prefill", "verify"} <= {s.name for s in spans if s.lane == "phases"}
    # every call and every phase but the verdicts (instants) inside one annotation, naming its positions and lane
    phases = [s for s in spans if s.lane == "phases"]
    assert len(names) == len(calls) + sum(s.name != "verify" for s in phases)
    annotated = sorted(name.split(" pos ")[1] for name in names if " pos " in name)
    assert annotated == sorted(f"{s.positions[0]}-{s.positions[1] - 1} lane {s.lane}" for s in calls)
    # the policy, not the thresholds (0: every head's top-1 would exit), decided every exit
    assert asked and {layer for _, layer in asked} >= {1, 3}
    assert set(traced.stats.exits_per_layer) == {3} and traced.stats.exits_per_layer[3] > 0
    assert set(plain.stats.exits_per_layer) - {3}  # without the policy, tokens exit below layer 3 as well


def test_tracing_of_another_type_is_refused_before_decoding(stories_export):
    with load(stories_export[0]) as model:
        with pytest.raises(UserInputError, match="tracing must be a paradecode.runtime.Tracing, got bool"):
            model.generate(prompt_ids=PROMPT, tracing=True)
        with pytest.raises(TypeError, match="trace"):
            model.generate(prompt_ids=PROMPT, trace=True)  # the keyword it replaced


def test_an_exit_policy_turns_adaptive_speculation_off(stories_export):
    """Exits decided by a measuring tool's policy are not second-guessed by adaptive speculation's estimates."""
    from paradecode.runtime.decoding import DecodeContext
    from paradecode.runtime.engine import executor_of
    from paradecode.runtime.stats import GenerationStats
    from paradecode.runtime.tracing import Timeline

    with load(stories_export[0]) as model:
        request = model.request(prompt_ids=PROMPT, max_new_tokens=8, adaptive=True)
        ctx = DecodeContext(model.backend, model.backend.allocate_cache(), Timeline())
        made = {
            policy is None: executor_of(model.runtime, request, ctx, PROMPT, GenerationStats("x"), exit_policy=policy)
            for policy in (None, lambda position, layer, out: None)
        }
    assert made[True].planner.speculation is model.speculation  # adapting, with the model's estimates
    assert made[False].planner.speculation is None and made[False].exits.policy is not None
