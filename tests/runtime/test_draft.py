"""ParaDecode with the draft head (runtime/proposers.py `DraftProposer`): its guesses are verified as lookup's, so the
output is plain decoding's, greedy or sampled, alone and in a batch; its cache holds what the verified positions give.

Every family's `exports` fixture has an untrained draft head: its guesses are mostly wrong, so most are rolled back,
which is what exactness has to survive. Lookup and the exit heads are off in these requests (lookup_tokens 0,
thresholds never), so every proposal is the draft head's.
"""

from __future__ import annotations

import pytest
import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.tensors import EMBEDDED, HIDDEN, HIDDEN_OUT, INPUT_IDS, PAST_KEY, PAST_VALUE, POSITIONS
from paradecode.runtime.engine import Engine, Sequence, generate_batched
from paradecode.runtime.speculation import Speculation
from tests.runtime.test_batching import SHAPES, Collect, alone, decoded_alone, prompts_of

BACKENDS = ("onnxruntime", "torch")
DRAFT_ONLY = dict(mode="paradecode", draft_tokens=3, lookup_tokens=0, thresholds=float("inf"))


def draft_requests(model, **settings):
    prompts = prompts_of(model.manifest.spec.vocab_size)
    return [
        model.request(prompt_ids=ids, max_new_tokens=new, ignore_eos=True, **{**DRAFT_ONLY, **settings})
        for ids, (_, new) in zip(prompts, SHAPES)
    ]


def plain_of(model, **settings):
    """`draft_requests(model, **settings)` decoded plainly."""
    return draft_requests(model, **settings, mode="ar")


@pytest.mark.parametrize("backend", BACKENDS)
def test_paradecode_with_the_draft_head_is_plain_decoding(loaded, family, backend):
    model = loaded[family, backend]
    results = [decoded_alone(model, r) for r in draft_requests(model)]
    assert [r.token_ids for r in results] == alone(model, plain_of(model))
    proposed = sum(r.stats.draft_proposed for r in results)
    assert proposed > 0 and sum(r.stats.lookup_proposed for r in results) == 0
    assert sum(r.stats.draft_accepted for r in results) <= proposed
    assert sum(r.stats.rollbacks for r in results) > 0  # an untrained head: rejections were rolled back


@pytest.mark.parametrize("overlap", ["streams", "both"])
def test_the_draft_head_beside_side_lanes_and_exits_is_plain_decoding(loaded, overlap):
    """Side lanes compute pending groups while lane 0 drafts; exits on every token (threshold 0) propose unverified
    tokens, after which the draft head proposes nothing until the verdicts reach them."""
    model = loaded["mistral", "onnxruntime"]
    settings = dict(overlap=overlap, thresholds=0.0)
    results = [decoded_alone(model, r) for r in draft_requests(model, **settings)]
    assert [r.token_ids for r in results] == alone(model, plain_of(model, **settings))
    assert sum(r.stats.draft_proposed for r in results) > 0
    assert sum(sum(r.stats.exits_per_layer.values()) for r in results) > 0


def test_paradecode_with_the_draft_head_samples_what_plain_decoding_samples(loaded):
    model = loaded["qwen2", "onnxruntime"]
    settings = dict(temperature=0.8, top_p=0.95, seed=11)
    got = [decoded_alone(model, r) for r in draft_requests(model, **settings)]
    assert [r.token_ids for r in got] == alone(model, plain_of(model, **settings))
    assert sum(r.stats.draft_proposed for r in got) > 0
    greedy = alone(model, draft_requests(model))
    assert [r.token_ids for r in got] != greedy  # it did sample


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_batchs_rows_verify_their_draft_heads_guesses(loaded, sampled, monkeypatch):
    """Rows of different lengths, a batch of fewer rows than requests (rows leave, are refilled, move): each row's
    guesses (drafted in calls of its row alone) go through the batch's calls, and every output is its request's
    alone. The batch takes every proposal (how many the measured costs let through is timing: test_batching.py)."""
    monkeypatch.setattr(Speculation, "batch_proposals", lambda self, available: max(available, default=0))
    model = loaded["llama", "torch"]
    settings = dict(temperature=0.7, seed=3) if sampled else {}
    requests = draft_requests(model, **settings)
    got = generate_batched(model.runtime, requests, rows=3)
    assert [r.token_ids for r in got] == alone(model, plain_of(model, **settings))
    assert sum(r.stats.draft_proposed for r in got) > 0


def reference_rows(model, tokens: list[int], layer: int) -> torch.Tensor:
    """The draft's cache rows [H_kv, n, D_h] of positions 1..n (n = len(tokens) - 1), from one call of every graph
    over the whole sequence: the last layer's outputs of positions 0..n-1 beside the embeddings of tokens 1..n."""
    backend, spec = model.backend, model.manifest.spec
    cache = backend.allocate_cache()
    n = len(tokens) - 1
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    embed_feeds = {INPUT_IDS: ids}
    if spec.positions == "learned":
        embed_feeds[POSITIONS] = positions
    embedded = backend.run("embed", embed_feeds)[HIDDEN]
    cache.reserve(len(tokens))
    hidden = embedded
    for i in range(1, spec.num_layers + 1):
        key, value = cache.layer(i)
        feeds = {HIDDEN: hidden, POSITIONS: positions, PAST_KEY: key, PAST_VALUE: value}
        hidden = backend.run(f"layer_{i}", feeds)[HIDDEN_OUT]
    key, value = cache.layer(layer)
    feeds = {HIDDEN: hidden[:, :n], EMBEDDED: embedded[:, 1:], POSITIONS: positions[:, 1:], PAST_KEY: key}
    backend.run("draft", {**feeds, PAST_VALUE: value})
    return key[0, :, 1 : n + 1]


@pytest.mark.parametrize("rows", [1, 2])
def test_the_draft_cache_holds_what_the_verified_positions_give(loaded, rows):
    """After decoding (alone: the executor's groups, rollbacks; two rows: the batch's steps), the draft head's cache
    rows of every position it fed equal one call's over the final sequence: it was fed the last layer's outputs of
    verified positions only, each beside the token after it."""
    model = loaded["gemma3", "onnxruntime"]
    layer = model.manifest.spec.num_layers + 1
    requests = draft_requests(model)[:rows]
    engine = Engine(model.runtime, rows)
    sinks = [Collect() for _ in requests]
    sequences = [Sequence.of(r, sink, model.runtime) for r, sink in zip(requests, sinks)]
    for sequence in sequences:
        engine.join(sequence)
    fed = {}
    while engine.size:
        for row, sequence in enumerate(engine.sequences):
            fed[id(sequence)] = (row, sequence.draft.fed)
        key = engine.cache.layer(layer)[0].clone()
        engine.step()
    for sequence, sink in zip(sequences, sinks):
        row, end = fed[id(sequence)]
        tokens = [*sequence.request.ids, *sink.tokens]
        assert end > len(sequence.request.ids)  # the prompt's positions and some generated ones were fed
        want = reference_rows(model, tokens[:end], layer)
        torch.testing.assert_close(key[row, :, 1:end], want, rtol=1e-3, atol=1e-4)


def test_an_export_without_a_draft_head_refuses_draft_tokens(identity_exports):
    from paradecode.runtime import load

    with load(identity_exports["llama"][0]) as model:
        with pytest.raises(UserInputError, match=r"draft_tokens 3 asks for .* has none: re-export .*--draft-head"):
            model.request(prompt_ids=[1, 2], draft_tokens=3)
        model.request(prompt_ids=[1, 2], draft_tokens=0)  # off: no draft head needed
    with pytest.raises(UserInputError, match="draft_tokens must be a non-negative integer"):
        from paradecode.runtime.config import GenerationConfig

        GenerationConfig(draft_tokens=-1)
