"""Resolving a request (runtime/request.py): one pure function from a model's facts, the settings and the prompt to
a frozen `Request`; everything a request is refused for is refused there; the engine takes a runtime, never a model."""

from __future__ import annotations

import ast
import dataclasses
import logging
import threading
from pathlib import Path

import pytest

from paradecode.graphs.errors import PromptError, PromptTooLongError, SettingError, UserInputError
from paradecode.runtime import load
from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.engine import Engine, Runtime, Sequence, StreamedToken
from paradecode.runtime.lookup import SharedSuffixIndex
from paradecode.runtime.notices import Notices
from paradecode.runtime.request import ALONE, IDLE, INEXACT, UNTRAINED, UNTRAINED_NO_LOOKUP, ModelFacts, resolve
from paradecode.runtime.row_exactness import ALONE as EVERY_POSITION_ALONE
from paradecode.runtime.row_exactness import AS_IS
from paradecode.runtime.speculation import Speculation

FACTS = ModelFacts(
    name="tiny",
    path="/exports/tiny",
    vocab_size=50,
    capacity=32,
    eos=(2,),
    thresholds={1: 0.8, 2: 0.9},
    trained_heads=True,
    draft_head=False,
    with_logits=True,
    has_tokenizer=False,
    device="cpu",
    row_form=AS_IS,
)


def test_a_request_is_a_pure_function_of_its_inputs():
    config = GenerationConfig(max_new_tokens=7, temperature=0.5, lookup_tokens=0, thresholds=0.7)
    first, again = resolve(FACTS, config, [1, 3, 5], seed=11), resolve(FACTS, config, [1, 3, 5], seed=11)
    assert first == again and first.ids == (1, 3, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.ids = (4,)
    with pytest.raises(TypeError):
        first.thresholds[1] = 0.1  # read-only
    assert first.sampling.seed == 11 and first.sampling.temperature == 0.5  # the seed drawn for it
    assert resolve(FACTS, dataclasses.replace(config, seed=3), [1], seed=11).sampling.seed == 3  # its own
    assert first.thresholds == {1: 0.7, 2: 0.7} and first.overlap == "batched"
    stops = first.stops
    assert (stops.prompt_tokens, stops.max_new_tokens, set(stops.eos), stops.capacity) == (3, 7, {2}, 32)
    assert not resolve(FACTS, dataclasses.replace(config, ignore_eos=True), [1], seed=0).stops.eos


@pytest.mark.parametrize(
    ("facts", "config", "mode", "warnings"),
    [
        (FACTS, GenerationConfig(), "paradecode", ()),
        (dataclasses.replace(FACTS, row_form=None), GenerationConfig(), "ar", (INEXACT,)),
        (dataclasses.replace(FACTS, row_form=EVERY_POSITION_ALONE), GenerationConfig(), "ar", (ALONE,)),
        (dataclasses.replace(FACTS, trained_heads=False), GenerationConfig(), "paradecode", (UNTRAINED,)),
        (
            dataclasses.replace(FACTS, trained_heads=False),
            GenerationConfig(lookup_tokens=0),
            "paradecode",
            (UNTRAINED_NO_LOOKUP,),
        ),
        (FACTS, GenerationConfig(temperature=0.7, lookup_tokens=0), "paradecode", (IDLE,)),
        (FACTS, GenerationConfig(mode="ar"), "ar", ()),
    ],
    ids=[
        "exact",
        "no exact form",
        "every position alone",
        "untrained heads",
        "untrained heads, no lookup",
        "nothing to speculate",
        "ar",
    ],
)
def test_the_mode_as_it_will_run_and_the_warnings_to_say(facts, config, mode, warnings):
    request = resolve(facts, config, [1, 2], seed=0)
    assert request.mode == mode and tuple(name for name, _ in request.warnings) == warnings
    assert request.speculates == (mode == "paradecode")
    if mode == "ar":
        assert not request.thresholds and not request.adaptive


def test_the_no_heads_notice_says_what_paradecode_still_does(identity_exports, caplog):
    """Without trained heads ParaDecode still proposes by lookup (Gemma 3 270M without heads ran 2.06x plain decoding):
    the notice said "decodes like ar", true only with lookup off. Each is said once by the model that meets it."""
    folder, _ = identity_exports["llama"]
    with caplog.at_level(logging.WARNING, logger="paradecode.runtime.model"), load(folder) as model:
        for lookup in (4, 4, 0, 0):
            model.generate(prompt_ids=[3, 4, 5], max_new_tokens=2, lookup_tokens=lookup)
    said = [r.getMessage() for r in caplog.records if "has no trained exit heads" in r.getMessage()]
    assert len(said) == 2, said
    assert "it still proposes tokens by prompt lookup" in said[0] and "like ar" not in said[0]
    assert "with lookup and the draft head off it proposes nothing: it decodes like ar" in said[1]
    # the draft head proposes with lookup off: the notice that says ParaDecode still proposes
    facts = dataclasses.replace(FACTS, trained_heads=False, draft_head=True)
    request = resolve(facts, GenerationConfig(lookup_tokens=0, draft_tokens=2), [1, 2], seed=0)
    assert [name for name, _ in request.warnings] == ["untrained"]
    assert [name for name, _ in resolve(facts, GenerationConfig(lookup_tokens=0), [1], seed=0).warnings] == [
        "untrained_no_lookup"
    ]


@pytest.mark.parametrize(
    ("facts", "config", "ids", "error", "message"),
    [
        (FACTS, GenerationConfig(), [], PromptError, "the prompt is empty"),
        (FACTS, GenerationConfig(), [1, 50], PromptError, r"prompt ids \[50\] are outside the vocabulary \(0..49\)"),
        (FACTS, GenerationConfig(), list(range(33)), PromptTooLongError, r"33 tokens, more than .*\(32 positions"),
        (FACTS, GenerationConfig(stop="x"), [1], SettingError, "need the export's tokenizer"),
        (
            dataclasses.replace(FACTS, with_logits=False),
            GenerationConfig(temperature=1.0),
            [1],
            SettingError,
            "no-logits",
        ),
        (FACTS, GenerationConfig(draft_tokens=2), [1], SettingError, "has none: re-export .* --draft-head"),
        (FACTS, {"max_new_tokens": 3}, [1], UserInputError, "config must be a GenerationConfig"),
    ],
)
def test_what_a_request_is_refused_for_is_refused_when_it_resolves(facts, config, ids, error, message):
    with pytest.raises(error, match=message) as refused:
        resolve(facts, config, ids, seed=0)
    if error is SettingError:  # it names the setting (a server names its request's field), the one given
        setting = refused.value.setting
        assert getattr(config, setting) != getattr(GenerationConfig(), setting), setting


def test_the_engine_takes_a_runtime_never_the_model():
    """runtime/engine.py imports nothing of the model and names no model: an engine over a runtime made here, of a
    backend alone, decodes a request resolved here."""
    source = (Path(__file__).parents[2] / "runtime" / "engine.py").read_text()
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom) and node.module}
    assert "paradecode.runtime.model" not in imported and "ParaDecodeModel" not in source
    assert ".model." not in source and "model =" not in source


def test_an_engine_decodes_over_a_runtime_of_its_own(exports):
    folder, _ = exports["llama"]
    with load(folder) as model:
        want = model.generate(prompt_ids=[3, 4, 5], max_new_tokens=6, ignore_eos=True)
        runtime = Runtime(
            backend=model.backend,
            tokenizer=None,
            lanes=1,
            estimates=Speculation(model.backend.spec.num_layers),
            shared_lookup=SharedSuffixIndex(),
            files=model.files,
            closing=threading.Event(),
            notices=Notices(),
        )
        request = resolve(model.facts, GenerationConfig(max_new_tokens=6, ignore_eos=True), [3, 4, 5], seed=0)
        events = []
        engine = Engine(runtime, 1)
        engine.join(Sequence.of(request, events.append, runtime, with_text=False))
        while engine.size:
            engine.step()
    assert [e.token for e in events if isinstance(e, StreamedToken)] == want.token_ids
