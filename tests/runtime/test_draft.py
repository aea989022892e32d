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
from paradecode.graphs.tensors import (
    EMBEDDED,
    FEATURES,
    HIDDEN,
    HIDDEN_OUT,
    INPUT_IDS,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
)
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


def test_adaptive_speculation_stops_drafting_what_is_not_accepted(loaded):
    """An untrained head's guesses are nearly never accepted: with adaptive speculation (greedy) the draft head is
    soon asked for nothing, but for every EXPLORE-th chain, and the output stays plain decoding's."""
    from paradecode.runtime.speculation import EXPLORE

    model = loaded["llama", "onnxruntime"]
    ids = prompts_of(model.manifest.spec.vocab_size)[0]
    settings = dict(prompt_ids=ids, max_new_tokens=48, ignore_eos=True, **DRAFT_ONLY)
    ar = model.generate(**{**settings, "mode": "ar"})
    forced = model.generate(**settings, adaptive=False)
    adaptive = model.generate(**settings, adaptive=True)
    assert forced.token_ids == ar.token_ids and adaptive.token_ids == ar.token_ids
    assert forced.stats.draft_accepted < forced.stats.draft_proposed / 4, forced.stats  # untrained: rejected
    steps = forced.stats.draft_proposed / DRAFT_ONLY["draft_tokens"]  # chains of 3 (some cut by the room left)
    assert adaptive.stats.draft_proposed < forced.stats.draft_proposed / 2, (adaptive.stats, forced.stats)
    assert adaptive.stats.draft_proposed >= DRAFT_ONLY["draft_tokens"] * (steps // EXPLORE) / 2


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
    monkeypatch.setattr(Speculation, "batch_proposals", lambda self, available, sources=None: max(available, default=0))
    model = loaded["llama", "torch"]
    settings = dict(temperature=0.7, seed=3) if sampled else {}
    requests = draft_requests(model, **settings)
    got = generate_batched(model.runtime, requests, rows=3)
    assert [r.token_ids for r in got] == alone(model, plain_of(model, **settings))
    assert sum(r.stats.draft_proposed for r in got) > 0


def test_a_batch_sizes_its_rows_draft_chains_as_a_lone_sequence_does(loaded, monkeypatch):
    """With adaptive speculation, a batch's rows ask an untrained head (its guesses nearly never accepted) for
    fewer guesses than they would otherwise draft, as a lone sequence does; every output is its request's alone."""
    from paradecode.runtime.proposers import DraftProposer

    asked = []
    propose = DraftProposer.propose

    def counted(self, ctx, tokens, end, count):
        asked.append(count)
        return propose(self, ctx, tokens, end, count)

    monkeypatch.setattr(DraftProposer, "propose", counted)
    model = loaded["llama", "onnxruntime"]
    forced = generate_batched(model.runtime, draft_requests(model, adaptive=False), rows=3)
    drafted_forced, asked[:] = sum(asked), []
    adaptive = generate_batched(model.runtime, draft_requests(model, adaptive=True), rows=3)
    plain = alone(model, plain_of(model))
    assert [r.token_ids for r in forced] == plain and [r.token_ids for r in adaptive] == plain
    assert 0 < sum(asked) < drafted_forced / 2, (sum(asked), drafted_forced)


def reference_rows(model, tokens: list[int], layer: int) -> torch.Tensor:
    """The draft's cache rows [H_kv, n, D_h] of positions 1..n (n = len(tokens) - 1), from one call of every graph
    over the whole sequence: the last layer's outputs of positions 0..n-1 beside the embeddings of tokens 1..n (for a
    head reading three layers, those outputs and the feature layers' through its map)."""
    backend, spec, features = model.backend, model.manifest.spec, model.manifest.feature_layers
    cache = backend.allocate_cache()
    n = len(tokens) - 1
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    embed_feeds = {INPUT_IDS: ids}
    if spec.positions == "learned":
        embed_feeds[POSITIONS] = positions
    embedded = backend.run("embed", embed_feeds)[HIDDEN]
    cache.reserve(len(tokens))
    hidden, outputs = embedded, []
    for i in range(1, spec.num_layers + 1):
        key, value = cache.layer(i)
        feeds = {HIDDEN: hidden, POSITIONS: positions, PAST_KEY: key, PAST_VALUE: value}
        hidden = backend.run(f"layer_{i}", feeds)[HIDDEN_OUT]
        outputs += [hidden] * features.count(i)
    fed = hidden[:, :n]
    if features:
        fed = backend.run("draft_reduce", {FEATURES: torch.cat([*outputs, hidden], dim=-1)[:, :n]})[HIDDEN]
    key, value = cache.layer(layer)
    feeds = {HIDDEN: fed, EMBEDDED: embedded[:, 1:], POSITIONS: positions[:, 1:], PAST_KEY: key}
    backend.run("draft", {**feeds, PAST_VALUE: value})
    return key[0, :, 1 : n + 1]


def draft_cache_matches_one_call(model, rows: int) -> None:
    """After decoding (alone: the executor's groups, rollbacks; two rows: the batch's steps), the draft head's cache
    rows of every position it fed equal one call's over the final sequence: it was fed the last layer's outputs (and
    the feature layers') of verified positions only, each beside the token after it."""
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


def test_a_feed_writes_the_newest_positions_rows_and_zeroes_the_older(loaded, monkeypatch):
    """With a feed window of 4, the first proposal after a prompt of 17 tokens writes the rows of positions 14..17
    alone (each as one call over the whole sequence gives it: a row reads only its own position's inputs) and zeroes
    1..13 whatever they held; the output stays plain decoding's."""
    from paradecode.runtime import proposers

    monkeypatch.setattr(proposers, "FEED_WINDOW", 4)
    model = loaded["llama", "onnxruntime"]
    request = draft_requests(model)[4]
    assert len(request.ids) == 17
    layer = model.manifest.spec.num_layers + 1
    engine = Engine(model.runtime, 1)
    key, value = engine.cache.layer(layer)
    key.fill_(7.0)  # what an earlier sequence left
    value.fill_(7.0)
    sink = Collect()
    sequence = Sequence.of(request, sink, model.runtime)
    engine.join(sequence)
    engine.step()  # the first proposal: a feed of the prompt's newest positions, then the chain
    key = engine.cache.layer(layer)[0]
    want = reference_rows(model, [*request.ids, *sink.tokens[:1]], layer)
    assert (
        torch.count_nonzero(key[0, :, 1:14]) == 0 and torch.count_nonzero(engine.cache.layer(layer)[1][0, :, 1:14]) == 0
    )
    torch.testing.assert_close(key[0, :, 14:18], want[:, 13:17], rtol=1e-3, atol=1e-4)
    while engine.size:
        engine.step()
    assert [*sink.tokens] == alone(model, plain_of(model)[4:])[0]
    assert sequence.stats.draft_proposed > 0


@pytest.mark.parametrize("rows", [1, 2])
def test_the_draft_cache_holds_what_the_verified_positions_give(loaded, rows):
    """Gemma 3's export: a draft head reading three layers' outputs (tests/conftest.py DRAFT_FEATURE_FAMILIES), each
    layer a call of its own (exit heads at every layer)."""
    model = loaded["gemma3", "onnxruntime"]
    assert model.manifest.feature_layers  # the cache's features are what its map read
    draft_cache_matches_one_call(model, rows)


@pytest.fixture(scope="module")
def segmented_features_export(tmp_path_factory, model_dirs):
    """Llama's tiny model (4 layers) without exit heads, exit layer 3, a head reading layers 2 and 3 beside the last:
    layers 1-2 run in one segment, which ends at a feature layer."""
    from paradecode.export.config import ExportConfig
    from paradecode.export.draft_head import load_draft_head, save_draft_head
    from paradecode.export.pipeline import export_model
    from tests.conftest import EXPORT_SEQ_LEN
    from tests.tiny_models import save_untrained_draft_head

    folder = tmp_path_factory.mktemp("segmented-features")
    draft = save_untrained_draft_head(model_dirs["llama"], folder / "draft.safetensors", features=True)
    tensors, metadata = load_draft_head(draft)
    save_draft_head(draft, tensors, dict(metadata, feature_layers=[2, 3]))
    out = folder / "export"
    config = ExportConfig(
        model=str(model_dirs["llama"]), output=out, draft_head=draft, exit_layers=(3,), max_seq_len=EXPORT_SEQ_LEN
    )
    export_model(config)
    return out


def test_segments_end_at_the_draft_heads_feature_layers(segmented_features_export):
    """The export's segments are cut after each feature layer, so the runtime keeps their outputs from the segments'
    own calls; ParaDecode with that head is plain decoding, alone and in a batch, and its cache holds what the
    verified positions give."""
    from paradecode.runtime import load

    with load(segmented_features_export) as model:
        manifest = model.manifest
        segments = [(s.io.layer, s.io.last) for s in manifest.subgraphs if s.io.kind == "segment"]
        assert manifest.feature_layers == (2, 3) and segments == [(1, 2)]
        assert manifest.subgraphs[-1].io.kind == "draft_reduce"
        calls = []
        run = model.backend.run
        model.backend.run = lambda name, *args, **kw: (calls.append(name), run(name, *args, **kw))[1]
        requests = draft_requests(model)
        results = [decoded_alone(model, r) for r in requests]
        assert [r.token_ids for r in results] == alone(model, plain_of(model))
        assert sum(r.stats.draft_proposed for r in results) > 0
        assert any(name.startswith("segment_") for name in calls) and "draft_reduce" in calls
        got = generate_batched(model.runtime, requests, rows=2)
        assert [r.token_ids for r in got] == [r.token_ids for r in results]
        draft_cache_matches_one_call(model, 2)


def test_an_export_without_a_draft_head_refuses_draft_tokens(identity_exports):
    from paradecode.runtime import load

    with load(identity_exports["llama"][0]) as model:
        with pytest.raises(UserInputError, match=r"draft_tokens 3 asks for .* has none: re-export .*--draft-head"):
            model.request(prompt_ids=[1, 2], draft_tokens=3)
        model.request(prompt_ids=[1, 2], draft_tokens=0)  # off: no draft head needed
    with pytest.raises(UserInputError, match="draft_tokens must be a non-negative integer"):
        from paradecode.runtime.config import GenerationConfig

        GenerationConfig(draft_tokens=-1)
