"""The one backend call (`Backend.run`): written once, each backend writing only its launch.

Every CPU backend, and on onnxruntime both of its launches (the persistent binding of calls of up to
BOUND_TOKENS tokens, and the binding made per call above that), is checked against the same
expectations: the shared check refuses a bad call before any launch, with a message naming the
subgraph, the tensor, what arrived and what was expected; and the outputs are the ones asked for,
the in-place ones being the fed cache buffers, the others tensors the caller owns.
"""

from __future__ import annotations

import pytest
import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.tensors import (
    HIDDEN,
    HIDDEN_OUT,
    LOGITS,
    MARGIN,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
    PRESENT_KEY,
    PRESENT_VALUE,
    PROB,
    TOKEN,
)
from paradecode.runtime.backends import backend_class
from paradecode.runtime.backends.base import Backend
from paradecode.runtime.backends.onnxruntime_backend import BOUND_TOKENS
from paradecode.runtime.loader import open_export

CPU_BACKENDS = ("torch", "onnxruntime")
# calls of these token counts take every launch: 1 and BOUND_TOKENS through onnxruntime's persistent binding,
# BOUND_TOKENS + 1 through a binding of its own
TOKEN_COUNTS = (1, BOUND_TOKENS, BOUND_TOKENS + 1)


@pytest.fixture(scope="module")
def backends(exports):
    """Each CPU backend over the llama export (trained exit heads, fused layer+exit graphs, logits)."""
    folder, _ = exports["llama"]
    export = open_export(folder)
    made = {name: backend_class(name)(export, device="cpu") for name in CPU_BACKENDS}
    yield made
    for backend in made.values():
        backend.close()


def layer_feeds(backend: Backend, tokens: int, start: int = 0) -> dict[str, torch.Tensor]:
    cache = backend.allocate_cache()
    key, value = cache.layer(1)
    hidden = torch.randn(1, tokens, backend.spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
    positions = torch.arange(start, start + tokens)[None]
    return {HIDDEN: hidden, POSITIONS: positions, PAST_KEY: key, PAST_VALUE: value}


def head_feeds(backend: Backend, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return {HIDDEN: torch.randn(1, tokens, backend.spec.hidden_size, generator=torch.Generator().manual_seed(seed))}


# --- the template -------------------------------------------------------------------------------------------


def test_a_backend_without_a_launch_cannot_be_made(exports):
    class NoLaunch(Backend):
        name = "no launch"

    with pytest.raises(TypeError, match="_launch"):
        NoLaunch(open_export(exports["llama"][0]))


def test_a_launch_is_all_a_backend_writes(exports):
    """A backend of nothing but a launch (zeros in buffers from the contract) gets the check, the in-place
    outputs and the filtering from `Backend.run`."""
    launched = []

    class Zeros(Backend):
        name = "zeros"

        def _launch(self, name, feeds, lane):
            launched.append((name, lane))
            buffers = self.output_buffers(name, feeds)
            for output in self.calls[name].produced:
                buffers[output].zero_()
            return buffers, False

    backend = Zeros(open_export(exports["llama"][0]))
    feeds = layer_feeds(backend, 2)
    out = backend.run("layer_1", feeds, "side1")
    assert launched == [("layer_1", "side1")]
    assert list(out) == [HIDDEN_OUT, PRESENT_KEY, PRESENT_VALUE]
    assert out[HIDDEN_OUT].shape == (1, 2, backend.spec.hidden_size) and not out[HIDDEN_OUT].any()
    assert out[PRESENT_KEY] is feeds[PAST_KEY] and out[PRESENT_VALUE] is feeds[PAST_VALUE]
    assert list(backend.run("final", head_feeds(backend, 1), outputs=(TOKEN, "no such output"))) == [TOKEN]
    with pytest.raises(UserInputError, match="positions"):
        backend.run("layer_1", {k: v for k, v in feeds.items() if k != POSITIONS})
    assert len(launched) == 2, "a refused call never reaches the launch"


# --- the shared check, on every CPU backend ---------------------------------------------------------------------


def refused(backend: Backend, monkeypatch, name: str, feeds: dict) -> str:
    """The message `run` refuses this call with; the launch must not be reached."""

    def launch(*args):
        raise AssertionError("the launch ran on a call the shared check should have refused")

    monkeypatch.setattr(backend, "_launch", launch)
    with pytest.raises(UserInputError) as info:
        backend.run(name, feeds)
    return str(info.value)


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_a_missing_or_unexpected_feed_is_refused_by_name(backends, backend_name, monkeypatch):
    backend = backends[backend_name]
    feeds = layer_feeds(backend, 1)
    missing = {k: v for k, v in feeds.items() if k != POSITIONS}
    message = refused(backend, monkeypatch, "layer_1", missing)
    print(message)
    assert "layer_1:" in message and "lack ['positions']" in message and "unexpected []" in message
    assert "its inputs are ['hidden', 'positions', 'past_key', 'past_value']" in message
    message = refused(backend, monkeypatch, "layer_1", {**feeds, "position_ids": feeds[POSITIONS]})
    assert "lack []" in message and "unexpected ['position_ids']" in message


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_a_feed_of_the_wrong_dtype_is_refused_naming_the_tensor(backends, backend_name, monkeypatch):
    backend = backends[backend_name]
    feeds = layer_feeds(backend, 2)
    message = refused(backend, monkeypatch, "layer_1", {**feeds, POSITIONS: feeds[POSITIONS].to(torch.int32)})
    print(message)
    assert message == (
        "layer_1: input positions arrived as torch.int32 [1, 2]; the contract expects int64 ['batch', 'tokens']."
    )
    message = refused(backend, monkeypatch, "final", {HIDDEN: head_feeds(backend, 1)[HIDDEN].double()})
    assert message.startswith("final: input hidden arrived as torch.float64 [1, 1, 48]; the contract expects float32")


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_an_unknown_subgraph_is_refused(backends, backend_name, monkeypatch):
    backend = backends[backend_name]
    message = refused(backend, monkeypatch, "layer_9", layer_feeds(backend, 1))
    assert message.startswith("the export has no subgraph 'layer_9'; it has [") and "'layer_4'" in message


# --- the outputs, on every CPU backend and launch ---------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_outputs_are_the_ones_asked_for_on_every_backend(backends, backend_name, tokens):
    backend = backends[backend_name]
    io = backend.subgraphs["layer_1"].io
    feeds = layer_feeds(backend, tokens)
    every = backend.run("layer_1", feeds)
    assert list(every) == io.output_names == [HIDDEN_OUT, PRESENT_KEY, PRESENT_VALUE]
    assert every[PRESENT_KEY] is feeds[PAST_KEY] and every[PRESENT_VALUE] is feeds[PAST_VALUE], "written in place"
    assert list(backend.run("layer_1", feeds, outputs=(HIDDEN_OUT,))) == [HIDDEN_OUT]
    assert list(backend.run("layer_1", feeds, outputs=(PRESENT_KEY,))) == [PRESENT_KEY]
    head = head_feeds(backend, tokens)
    assert list(backend.run("final", head)) == [TOKEN, PROB, MARGIN, LOGITS]
    assert list(backend.run("final", head, outputs=(MARGIN, TOKEN))) == [MARGIN, TOKEN]
    assert list(backend.run("final", head, outputs=(TOKEN, "no such output"))) == [TOKEN]
    exit_head = backend.run("exit_1", head, outputs=(TOKEN, LOGITS))
    assert exit_head[LOGITS].shape == (1, tokens, backend.manifest.head_vocab)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_every_backend_gives_the_same_outputs(backends, tokens):
    """The same call on each backend: the same tokens, hidden states within float32 rounding."""
    results = {}
    for name, backend in backends.items():
        feeds = layer_feeds(backend, tokens)
        hidden = backend.run("layer_1", feeds, outputs=(HIDDEN_OUT,))[HIDDEN_OUT]
        results[name] = hidden, backend.run("final", {HIDDEN: hidden}, outputs=(TOKEN,))[TOKEN]
    (a, token_a), (b, token_b) = results.values()
    print(f"T={tokens}: largest hidden_out difference {float((a - b).abs().max()):.2e}")
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4) and torch.equal(token_a, token_b)


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_a_cache_holds_finite_numbers_in_every_slot_it_hands_out(monkeypatch, backends, backend_name):
    """An exported layer attends over every slot of the cache it is given, masked (export/attention.py), and a
    masked NaN would still reach the output (0 x NaN): a cache holds zeros from the start and where it grows, never
    whatever memory held. The allocator made to return NaN shows it is not what a cache is made of."""
    real_empty = torch.empty
    backend = backends[backend_name]
    with monkeypatch.context() as patched:
        patched.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
        cache = backend.allocate_cache(2)
        cache.reserve(cache.shape[2])  # grown to every slot, where it grows
    for layer in range(1, cache.num_layers + 1):
        assert all(bool((buffer == 0).all()) for buffer in cache.layer(layer)), f"layer {layer}"
    for tokens in (1, 2):
        feeds = layer_feeds(backend, tokens)
        hidden = backend.run("layer_1", feeds, outputs=(HIDDEN_OUT,))[HIDDEN_OUT]
        assert not hidden.isnan().any(), f"{backend_name}, {tokens} tokens: NaN in the layer's output"


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
def test_outputs_are_the_callers_not_the_next_calls(backends, backend_name):
    """A backend that reuses its output buffers (onnxruntime's persistent binding) copies out what it returns:
    a later call leaves an earlier result as it was."""
    backend = backends[backend_name]
    first = backend.run("final", head_feeds(backend, 1, seed=1), outputs=(PROB, LOGITS))
    kept = {k: v.clone() for k, v in first.items()}
    backend.run("final", head_feeds(backend, 1, seed=2), outputs=(PROB, LOGITS))
    assert all(torch.equal(first[k], kept[k]) for k in kept)
