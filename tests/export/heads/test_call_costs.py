"""The one call-cost measurement (`export/heads/call_costs.py`), over an export's graphs and over graphs from a spec.

Correctness only: what is timed, through which call, and what the result holds; never how fast.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from paradecode.export.heads.call_costs import (
    CONTEXT,
    WARMUP,
    CallCosts,
    call_costs_from_spec,
    described,
    graphs_from_spec,
    measure_call_costs,
)
from paradecode.export.heads.cost_model import CostModel
from paradecode.runtime import row_exactness
from paradecode.runtime.backends import backend_class
from paradecode.runtime.loader import open_export
from paradecode.runtime.row_exactness import RowForm
from tests.export.heads.test_training import spec_of


@pytest.mark.parametrize("backend_name", ["torch", "onnxruntime"])
def test_an_exports_calls_are_timed_through_its_backend(exports, backend_name, monkeypatch):
    """Each call timed as the runtime makes it on the machine: here a form that pads calls to multiples of 4 rows
    (whatever this CPU's own form is), so one position is timed as 4 rows and six as 8."""
    folder, _ = exports["llama"]
    monkeypatch.setattr(row_exactness, "row_form", lambda backend: RowForm(multiple=4))
    with backend_class(backend_name)(open_export(folder)) as backend:
        rows = backend.row_form.rows
        assert (rows(1), rows(6)) == (4, 8)
        calls = Counter()
        run = backend.run

        def counted(name, feeds, lane="main", outputs=None):
            calls[name, next(iter(feeds.values())).shape[1], outputs] += 1
            return run(name, feeds, lane, outputs)

        monkeypatch.setattr(backend, "run", counted)
        cache = backend.allocate_cache()
        costs = measure_call_costs(backend, cache, (1, 6), rounds=2)
    heads = ("token", "prob", "margin")
    # every call as the runtime makes it on this machine: T positions as rows(T) rows (runtime/row_exactness.py)
    expected = {(f"layer_{i}", rows(t), ("hidden_out",)) for i in range(1, 5) for t in (1, 6)}
    expected |= {("exit_1", rows(1), heads), ("final", rows(1), heads), ("final", rows(6), heads)}
    expected |= {("embed", 1, ("hidden",))}
    assert set(calls) == expected and set(calls.values()) == {WARMUP + 2}, calls
    assert isinstance(costs, CallCosts) and set(costs.layer) == set(costs.final_head) == {1, 6}
    assert all(s > 0 for s in [*costs.layer.values(), *costs.final_head.values(), costs.exit_head, costs.embed])
    assert costs.context == cache.capacity - 6 < CONTEXT and costs.rounds == 2  # 64 slots less 3 spare ones
    assert costs.exit_vocab == backend.manifest.head_vocab
    assert costs.backend == ("torch CPU" if backend_name == "torch" else f"onnxruntime CPU, threads: {backend.threads}")
    # 4 layers and the draft head's (`exports` has one): nothing recorded as written, as decoding masks those slots
    assert cache.lengths == [0] * 5, "the measurement records nothing as written: decoding masks those slots"
    as_dict = costs.as_dict()
    assert set(as_dict["layer_ms"]) == set(as_dict["final_head_ms"]) == {"1", "6"}


def test_an_export_without_exit_graphs_times_the_final_head_as_its_exit_head(identity_exports):
    folder, _ = identity_exports["llama"]
    with backend_class("onnxruntime")(open_export(folder)) as backend:
        costs = measure_call_costs(backend, backend.allocate_cache(), (1, 2), rounds=1)
    assert costs.exit_vocab == backend.spec.vocab_size


@pytest.mark.slow
def test_a_specs_graphs_are_an_export_the_runtime_opens(tmp_path):
    """Traced from the spec, before any export: LAYER_COPIES (here every one of the 3) copies of a middle
    layer, an exit head over the reduced vocabulary, the final head, the embedding; learned positions too."""
    _, spec = spec_of("gpt2")
    export = graphs_from_spec(spec, 20, tmp_path)
    names = [s.io.name for s in export.manifest.subgraphs]
    assert names == ["layer_1", "layer_2", "layer_3", "exit_2", "final", "embed"]
    with backend_class("onnxruntime")(export) as backend:
        assert backend.manifest.head_vocab == 20
    costs = call_costs_from_spec(spec, 20, rounds=2)
    assert set(costs.layer) == {1, 2, 4} and costs.exit_vocab == 20 and costs.backend.startswith("onnxruntime CPU")
    assert CostModel.measured(spec.num_layers, costs).source == "measured"


@pytest.mark.slow
def test_call_costs_are_measured_with_onnxruntime():
    _, spec = spec_of("gpt2")  # learned positions: the embedding takes positions too
    costs = call_costs_from_spec(spec, 20, rounds=3)
    assert set(costs.layer) == set(costs.final_head) == {1, 2, 4}
    assert all(s > 0 for s in [*costs.layer.values(), *costs.final_head.values(), costs.exit_head, costs.embed])
    cost = CostModel.measured(spec.num_layers, costs)
    assert cost.source == "measured" and cost.num_layers == 3 and cost.head == costs.exit_head / costs.layer[1]


def test_the_record_names_the_threads():
    cpu = SimpleNamespace(type="cpu")
    assert described(SimpleNamespace(name="onnxruntime", device=cpu, threads=2)) == "onnxruntime CPU, threads: 2"
    assert described(SimpleNamespace(name="torch", device=cpu)) == "torch CPU"
