"""`chain_outputs` (export/draft/chain.py) against the draft graph as decoding calls it: for every chain start v and
depth k, one call over positions 1..v on a fresh cache (the feed), then one call per guess, each reading the previous
call's output (runtime/proposers.py `DraftProposer`). Every family, so the sliding windows, q/k norms and sandwich
norms of the last layer the draft copies are all met."""

from __future__ import annotations

import torch

from paradecode.export.draft.chain import chain_outputs, depth_mask

TOKENS, DEPTH = 11, 4


def decoded_chain(draft, hidden, embedded, start: int, depth: int, slots: int) -> list[torch.Tensor]:
    """o_1[start], o_2[start + 1], ...: the draft's outputs [D] along the chain from `start`, call by call."""
    spec = draft.layer.spec
    key = torch.zeros(1, spec.num_kv_heads, slots, spec.head_dim)
    value = torch.zeros_like(key)
    positions = torch.arange(1, start + 1)[None]
    out = draft(hidden[:, :start], embedded[:, 1 : start + 1], positions, key, value)[0][:, -1:]
    chain = [out[0, 0]]
    for position in range(start + 1, start + depth):
        out = draft(out, embedded[:, position : position + 1], torch.tensor([[position]]), key, value)[0]
        chain.append(out[0, 0])
    return chain


def test_chain_outputs_are_the_draft_graphs_calls_along_every_chain(family, loaded):
    backend = loaded[family, "torch"].backend
    draft = backend.modules["draft"]
    generator = torch.Generator().manual_seed(0)
    shape = (1, TOKENS, backend.spec.hidden_size)
    hidden, embedded = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    with torch.no_grad():
        outputs = chain_outputs(draft, hidden, embedded, DEPTH)
        checked = 0
        for start in range(1, TOKENS):
            depth = min(DEPTH, TOKENS - start)
            for k, expected in enumerate(decoded_chain(draft, hidden, embedded, start, depth, TOKENS), 1):
                position = start + k - 1
                assert depth_mask(TOKENS, k)[position - 1]
                torch.testing.assert_close(outputs[k - 1][0, position - 1], expected, rtol=1e-4, atol=1e-5)
                checked += 1
    assert checked == sum(min(DEPTH, TOKENS - start) for start in range(1, TOKENS))


def test_depth_mask_leaves_out_the_positions_no_chain_of_that_depth_reaches():
    assert depth_mask(6, 1).tolist() == [True] * 5
    assert depth_mask(6, 3).tolist() == [False, False, True, True, True]
