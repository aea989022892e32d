"""The ParaDecode planner without a backend or a model: a scripted model gives each position's true next token, scripted
exit heads and lookup proposals give tentative ones, and `Decode` below is the single-thread executor
(runtime/decoding.py's `Executor`) with its calls recorded, not made: its verdicts and rollbacks are the executor's
own. Then the verification function alone."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

from paradecode.graphs.errors import SchedulerStallError
from paradecode.runtime.decoding import Executor
from paradecode.runtime.lookup import LookupConfig
from paradecode.runtime.planner import Planner
from paradecode.runtime.proposers import ExitHeads, LookupProposer
from paradecode.runtime.sampling import SAMPLE, Draws, Sampler, SamplingParams
from paradecode.runtime.stats import LOOKUP, GenerationStats, Mismatch
from paradecode.runtime.stops import EOS, MAX_NEW_TOKENS, MAX_SEQ_LEN, Stops
from paradecode.runtime.verification import verify

VOCAB = 50
PROMPT = [1, 2]


def model(prefix: list[int]) -> int:
    """The scripted model: the token that follows `prefix` (what the final head gives at its last position)."""
    return (prefix[-1] * 7 + len(prefix) * 3 + 1) % VOCAB


def plain(count: int, prompt: list[int] = PROMPT) -> list[int]:
    """Plain decoding's first `count` tokens after `prompt`."""
    tokens = list(prompt)
    while len(tokens) < len(prompt) + count:
        tokens.append(model(tokens))
    return tokens[len(prompt) :]


class Out(NamedTuple):
    """A head's output at some positions, as the executor hands it over: plain lists."""

    token: list[int]
    prob: list[float]
    margin: list[float]


def confident(position: int, layer: int, tokens: list[int]) -> Out:
    """An exit head that always proposes the right token, confidently."""
    return Out([model(tokens[: position + 1])], [0.9], [1.0])


def unsure(position: int, layer: int, tokens: list[int]) -> Out:
    return Out([model(tokens[: position + 1])], [0.1], [0.1])


class Call(NamedTuple):
    """What one step computed: positions start..end-1, layers first..last, then maybe an exit head."""

    start: int
    end: int
    first: int  # 0: the embedding first
    last: int
    exit: bool


class Recorder:
    """Adaptive speculation that always says yes, recording what it is told."""

    def __init__(self):
        self.calls = []

    def try_exit(self, layer, head_is_final=False):
        return True

    def head_called(self, layer, exited):
        self.calls.append(("head", layer, exited))

    def verified(self, source, accepted, depth=None):
        self.calls.append(("verified", source, accepted, depth))

    def lookup_tokens(self, count):
        self.calls.append(("lookup", count))
        return count


class Script:
    """A lookup proposer answering from a script: {position: the tokens to propose after it}."""

    max_tokens = 8

    def __init__(self, answers):
        self.answers = answers
        self.asked = []  # (position, count)

    def extend(self, tokens, upto):
        pass

    def propose(self, tokens, end, count, verified):
        self.asked.append((end - 1, count))
        return list(self.answers.get(end - 1, ()))[:count]


class NoCalls:
    """The part of a `DecodeContext` the executor reads besides its calls (which `Decode.step` makes up): a KV cache
    whose lengths nothing here reads, no profiling."""

    annotate = None

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.backend = SimpleNamespace(device=SimpleNamespace(type="cpu"))
        self.cache = SimpleNamespace(written=lambda layer, end: None, rollback=lambda length: None)

    def phase(self, name, positions):
        return contextlib.nullcontext()


class Decode(Executor):
    """One request decoded by the planner with the single-thread executor, whose calls are recorded and answered by
    the scripted model instead of made. Hidden states are the tuples of their positions, so a merge (`join`) must put
    them in order."""

    def __init__(
        self,
        head=unsure,
        *,
        L=4,
        exit_layers=(2,),
        K=4,
        merge=True,
        max_new_tokens=12,
        eos=(),
        capacity=64,
        lookup=None,
        speculation=None,
        prompt=PROMPT,
    ):
        self.prompt = list(prompt)
        self.stops = Stops(len(prompt), max_new_tokens, frozenset(eos), capacity)
        self.stats = GenerationStats("paradecode")
        self.exits = ExitHeads(dict.fromkeys(exit_layers, 0.5), {f"exit_{e}" for e in exit_layers})
        self.head = head
        self.joins = []
        self.steps: list[Call] = []
        self.unverified: list[int] = []  # before each step
        self.rollbacks: list[tuple[int, int]] = []  # (position, the token that replaced its successor)
        self.planner = Planner(
            prompt,
            num_layers=L,
            exits=self.exits,
            max_unverified=K,
            merge=merge,
            last_position=self.stops.last_position - 1,
            eos=self.stops.eos,
            stats=self.stats,
            lookup=lookup,
            speculation=speculation,
            join=self.join,
        )
        super().__init__(NoCalls(L), prompt, self.stops, self.planner, self.exits, None)

    def join(self, before, after):
        assert before[-1] + 1 == after[0], (before, after)
        self.joins.append((before, after))
        return before + after

    def run(self) -> list[tuple[int, str | None]]:
        """The verified tokens and the stop decision after each, the first token (the prefill's) plain decoding's."""
        planner, position = self.planner, len(self.prompt)
        first = model(self.prompt)
        planner.begin(first)
        yielded = [(first, self.stops.after(first, position))]
        if yielded[-1][1] is not None:
            return yielded
        planner.start_frontier(position, first)
        for _ in range(1000):
            for token, _margin in self.verify_finished():
                position += 1
                yielded.append((token, self.stops.after(token, position)))
                if yielded[-1][1] is not None:
                    return yielded
            self.unverified.append(len(planner.tokens) - planner.verified)
            self.step()
        raise AssertionError("no stop after 1000 steps")

    def step(self) -> None:
        planner = self.planner
        step = planner.next_step()
        assert step is not None, "a single thread always has something to compute"
        group, last, exit_now, _ = step  # no fused graphs here
        start, end = group.start, group.end
        positions = tuple(range(start, end))
        assert group.depth == -1 or group.hidden == positions
        self.steps.append(Call(start, end, group.depth + 1, last, exit_now))
        final = None
        if last == planner.L:  # the final head: the model's token after each position, the position as its margin
            truth = [model(planner.tokens[: q + 1]) for q in positions]
            final = Out(truth, [1.0] * len(positions), [float(q) for q in positions])
        planner.computed(group, last, positions, final)
        if exit_now:
            out = self.head(end - 1, last, planner.tokens)
            planner.exit_proposed(group, last, self.exits.propose(end - 1, last, out))

    def rollback(self, position: int, token: int) -> None:
        self.rollbacks.append((position, token))
        super().rollback(position, token)


def decoded(decode: Decode) -> list[int]:
    return [t for t, _ in decode.run()]


def groups(planner: Planner) -> list[tuple[int, int, int]]:
    return [(g.start, g.end, g.depth) for g in planner.groups]


def planned(step) -> tuple[int, int, int, bool]:
    return step.group.start, step.group.end, step.last, step.exit


# --- the planner ----------------------------------------------------------------------------------------------------
def test_the_docstring_example():
    """runtime/planner.py's worked example, step by step."""
    decode = Decode(K=4)
    planner = decode.planner
    planner.begin(7)
    planner.start_frontier(2, 7)
    assert groups(planner) == [(2, 3, -1)]
    step = planner.next_step()
    assert planned(step) == (2, 3, 2, True)
    planner.computed(step.group, 2, (2,), None)
    planner.exit_proposed(step.group, 2, 9)
    assert planner.tokens == [1, 2, 7, 9] and groups(planner) == [(2, 3, 2), (3, 4, -1)]
    step = planner.next_step()
    assert planned(step) == (3, 4, 2, True)
    planner.computed(step.group, 2, (3,), None)
    planner.exit_proposed(step.group, 2, None)
    step = planner.next_step()
    assert planned(step) == (2, 4, 4, False)
    assert decode.joins == [((2,), (3,))]
    planner.computed(step.group, 4, (2, 3), Out([9, 4], [1.0, 1.0], [0.5, 0.25]))
    group, out = planner.take_verifiable(), []
    assert planner.settle(group, 1, 4, out) == -1
    assert out == [(9, 0.5), (4, 0.25)] and planner.tokens == [1, 2, 7, 9, 4] and planner.verified == 5
    assert groups(planner) == [(4, 5, -1)]


def test_an_accepted_exit_lets_the_next_token_start_at_once():
    decode = Decode(confident, K=4, max_new_tokens=10)
    assert decoded(decode) == plain(10)
    stats = decode.stats
    assert stats.exits_per_layer.get(2, 0) >= 3 and stats.accepted_per_layer == stats.exits_per_layer
    assert stats.rollbacks == 0 and stats.mismatches == []
    # position 2 exits after layer 2, and position 3 starts at once, up to layer 2, where it may exit too
    assert decode.steps[:2] == [Call(2, 3, 0, 2, True), Call(3, 4, 0, 2, True)]
    # the early tokens' remaining layers ran in later positions' calls: groups merged into calls of several positions
    assert any(s.first == 3 and s.end - s.start > 1 for s in decode.steps)


def test_a_rejected_exit_rolls_back_and_goes_on_from_the_final_layers_token():
    right = plain(6)

    def wrong_at_3(position, layer, tokens):
        if position == 3:
            return Out([(model(tokens[:4]) + 1) % VOCAB], [0.9], [1.0])
        return unsure(position, layer, tokens)

    decode = Decode(wrong_at_3, max_new_tokens=6)
    assert decoded(decode) == right
    stats = decode.stats
    assert stats.rollbacks == 1 and stats.exits_per_layer == {2: 1} and stats.accepted_per_layer == {}
    assert stats.mismatches == [Mismatch(4, 2, (right[2] + 1) % VOCAB, right[2], 3.0)]
    assert decode.rollbacks == [(3, right[2])]
    # the wrong token at position 4 went up to the last layer with position 3; then position 4 started again, from
    # its embedding, with the final layer's token
    rolled = next(i for i, s in enumerate(decode.steps) if s.first == 3 and (s.start, s.end) == (3, 5))
    assert decode.steps[rolled + 1] == Call(4, 5, 0, 2, True)


def test_the_rollback_discards_every_later_position():
    decode = Decode(max_new_tokens=8, lookup=Script({2: [plain(2)[1], 5, 6, 7]}), K=8)
    planner = decode.planner
    planner.begin(plain(1)[0])
    planner.start_frontier(2, plain(1)[0])
    assert planner.tokens == [1, 2, *plain(2), 5, 6, 7]
    assert groups(planner) == [(2, 7, -1)]
    planner.rollback(2, 30)  # tokens[3] was wrong: 30 replaces it
    assert planner.tokens == [1, 2, plain(1)[0], 30] and planner.verified == 4
    assert planner.source_of == {} and planner.proposal_depth == {} and planner.stats.rollbacks == 1
    assert groups(planner) == [(3, 4, -1)]


def test_lookup_proposals_partly_accepted():
    right = plain(12)
    lookup = Script({2: [right[1], right[2], (right[3] + 1) % VOCAB, 11]})
    speculation = Recorder()
    decode = Decode(exit_layers=(), K=8, lookup=lookup, speculation=speculation)
    assert decoded(decode) == right
    stats = decode.stats
    assert (stats.lookup_proposed, stats.lookup_accepted, stats.rollbacks) == (4, 2, 1)
    assert stats.mismatches == [Mismatch(5, LOOKUP, (right[3] + 1) % VOCAB, right[3], 4.0)]
    # the proposals went up the layers with their position's token, in one call per step
    assert decode.steps[0] == Call(2, 7, 0, 4, False)
    verdicts = [c for c in speculation.calls if c[0] == "verified"]
    # depths 1 and 2 accepted, 3 rejected, and the 4th discarded unjudged (depth None) counts as rejected
    assert verdicts == [
        ("verified", LOOKUP, True, 1),
        ("verified", LOOKUP, True, 2),
        ("verified", LOOKUP, False, 3),
        ("verified", LOOKUP, False, None),
    ]
    assert ("lookup", 4) in speculation.calls
    assert lookup.asked[0] == (2, 8)  # the room: K with nothing unverified, within the max_tokens


def test_a_lookup_proposal_ending_with_the_eos_ends_the_output_there():
    free = plain(20)
    k = next(i for i in range(3, 20) if free[i] not in free[:i])  # the EOS: its first occurrence
    assert k <= 6  # all proposed at once (K = 8), and two more after the EOS
    lookup = Script({2: [*free[1 : k + 1], 17, 18]})
    decode = Decode(confident, K=8, lookup=lookup, eos=(free[k],), max_new_tokens=20)
    yielded = decode.run()
    assert [t for t, _ in yielded] == free[: k + 1] and yielded[-1][1] == EOS
    assert all(s is None for _, s in yielded[:-1])
    assert decode.stats.lookup_proposed == decode.stats.lookup_accepted == k  # none proposed past the EOS
    assert decode.stats.exits_per_layer == {}
    assert [p for p, _ in lookup.asked] == [2]  # nothing proposed after the EOS
    assert not any(s.exit for s in decode.steps)  # the proposed EOS is the frontier's newest: it never exits
    assert decode.planner.frontier is None and decode.planner.groups == []


def test_an_exit_proposing_the_eos_starts_nothing_after_it():
    free = plain(20)
    k = next(i for i in range(3, 20) if free[i] not in free[:i])
    decode = Decode(confident, K=8, eos=(free[k],), max_new_tokens=20)
    yielded = decode.run()
    assert [t for t, _ in yielded] == free[: k + 1] and yielded[-1][1] == EOS
    eos_position = len(PROMPT) + k
    assert decode.stats.exits_per_layer[2] >= 1 and decode.stats.rollbacks == 0
    assert max(s.end for s in decode.steps) == eos_position  # no call computed the EOS's position or later


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_max_new_tokens(max_new_tokens):
    right = plain(max_new_tokens)
    lookup = Script({q: plain(q + 10)[q - 1 : q + 9] for q in range(2, 30)})  # long, right proposals everywhere
    decode = Decode(confident, K=8, lookup=lookup, max_new_tokens=max_new_tokens)
    yielded = decode.run()
    assert [t for t, _ in yielded] == right and yielded[-1][1] == MAX_NEW_TOKENS
    last_needed = len(PROMPT) + max_new_tokens - 2  # its final output is the last token
    assert all(s.end - 1 <= last_needed for s in decode.steps)
    assert all(position + count <= last_needed for position, count in lookup.asked)
    frontier = decode.planner.frontier  # nothing starts past the last needed position
    assert all(position <= last_needed for position, _ in lookup.asked) and (
        frontier is None or frontier.start <= last_needed
    )
    assert decode.stats.rollbacks == 0


def test_the_cache_end_stops_decoding():
    capacity = len(PROMPT) + 5  # slots 0..6: the token at position 7 is the last one, never stored
    lookup = Script({q: plain(q + 10)[q - 1 : q + 9] for q in range(2, 30)})
    decode = Decode(confident, K=8, lookup=lookup, capacity=capacity, max_new_tokens=100)
    yielded = decode.run()
    assert [t for t, _ in yielded] == plain(capacity - len(PROMPT) + 1) and yielded[-1][1] == MAX_SEQ_LEN
    assert max(s.end for s in decode.steps) == capacity  # no call of a position without a slot
    assert all(position + count <= capacity - 1 for position, count in lookup.asked)
    frontier = decode.planner.frontier
    assert all(position < capacity for position, _ in lookup.asked) and (frontier is None or frontier.start < capacity)


@pytest.mark.parametrize("lookup", [False, True], ids=["exits", "exits and lookup"])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_at_most_k_tokens_are_unverified(K, lookup):
    proposals = Script({q: plain(q + 10)[q - 1 : q + 9] for q in range(2, 30)}) if lookup else None
    decode = Decode(confident, exit_layers=(1, 2, 3), K=K, max_new_tokens=16, lookup=proposals)
    assert decoded(decode) == plain(16)
    assert max(decode.unverified) == K  # the limit is reached, never passed
    for unverified, step in zip(decode.unverified, decode.steps):
        assert not (step.exit and unverified >= K)  # no exit with K tokens unverified already


def test_groups_at_one_depth_merge_in_batched_and_wait_otherwise():
    merged = Decode(confident, K=3, max_new_tokens=12)
    alone = Decode(confident, K=3, max_new_tokens=12, merge=False)
    assert decoded(merged) == decoded(alone) == plain(12)
    assert merged.joins and not alone.joins
    assert any(s.end - s.start > 1 for s in merged.steps)
    assert all(s.end - s.start == 1 for s in alone.steps)  # each group computed on its own: more calls
    assert len(alone.steps) > len(merged.steps)


def test_a_busy_group_is_never_merged():
    """A side lane's claimed group stays its own until the lane publishes: the frontier waits for it."""
    decode = Decode(confident, K=4)
    planner = decode.planner
    planner.begin(model(PROMPT))
    planner.start_frontier(2, model(PROMPT))
    decode.step()  # position 2 up to layer 2, then it exits: position 3 starts
    decode.step()  # position 3 up to layer 2, then it exits too
    pending, second = planner.groups[0], planner.groups[1]
    assert (pending.start, pending.depth, second.start, second.depth, planner.frontier.start) == (2, 2, 3, 2, 4)
    assert planner.claim(latest=False) is pending and pending.busy  # a side lane takes position 2
    step = planner.next_step()  # the frontier at position 4 may go to layer 2: that is not the question here
    assert step.group is planner.frontier and step.group.start == 4
    planner.computed(step.group, 2, (4,), None)
    planner.exit_proposed(step.group, 2, None)
    assert planner.next_step() is None  # 4 merged with 3, which waits for busy 2 (same depth): nothing to do
    assert groups(planner) == [(2, 3, 2), (3, 5, 2)]
    planner.computed(pending, 3, (2,), None)  # the side lane publishes layer 3
    assert planned(planner.next_step()) == (3, 5, 3, False)  # 3 and 4, merged, up to 2's depth


def test_running_out_of_work_without_a_stop_is_reported():
    decode = Decode()
    decode.planner.begin(5)
    with pytest.raises(SchedulerStallError, match="without a stop decision"):
        decode.planner.next_step()  # no frontier was started, and nothing is pending


def test_the_planner_imports_no_torch():
    code = "import sys, paradecode.runtime.planner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_lookup_proposer_asks_the_request_first_then_earlier_requests():
    from paradecode.runtime.lookup import SharedSuffixIndex

    tokens = [5, 6, 7, 9, 4, 6, 7, 8, 1, 5, 6, 7]
    shared = SharedSuffixIndex()
    shared.add([0], [5, 6, 7, 1, 1, 2, 3, 8, 1])
    proposer = LookupProposer(LookupConfig(length_factor=1.0), shared)
    assert shared.propose(tokens, 12, 5) == [1, 1, 2]
    assert proposer.propose(tokens, 12, 5, verified=12) == [9, 4, 6]  # the request's own match first
    assert proposer.propose([2, 3], 2, 5, verified=2) == [8, 1]  # none in the request: an earlier output's
    assert LookupProposer(LookupConfig()).propose([2, 3], 2, 5, verified=2) == []


def test_exit_heads_propose_by_threshold_or_policy():
    heads = ExitHeads({2: 0.8, 3: 2.0}, {"exit_2", "layer_exit_2"})
    assert heads.thresholds == {2: 0.8} and heads.head == {2: "exit_2"} and heads.fused == {2}
    assert heads.propose(9, 2, Out([17], [0.91], [1.0])) == 17
    assert heads.propose(9, 2, Out([17], [0.42], [1.0])) is None
    assert ExitHeads({1: 0.5}, set()).head == {1: "final"}  # no trained head: the final head's graph
    policy = ExitHeads({2: 0.8}, set(), policy=lambda position, layer, out: 5 if position % 2 else None)
    assert policy.propose(9, 2, Out([17], [0.1], [1.0])) == 5 and policy.propose(8, 2, Out([17], [1.0], [1.0])) is None


# --- verification -----------------------------------------------------------------------------------------------------
def test_greedy_verification():
    tokens = [0] * 10 + [7, 9, 4, 8]  # positions 10-13: 9, 4 and 8 proposed to follow 10, 11 and 12
    assert verify(Out([9, 4, 5, 2], [], []), tokens, 10, 14, True) == (2, 5)
    assert verify(Out([9, 4, 8, 2], [], []), tokens, 10, 14, True) == (3, 2)  # then the bonus token
    assert verify(Out([9, 4, 8, 2], [], []), tokens, 10, 14, False) == (3, None)  # none wanted (after an EOS)
    assert verify(Out([3, 4, 8, 2], [], []), tokens, 10, 14, True) == (0, 3)
    assert verify(Out([9, 4], [], []), tokens, 10, 12, True) == (2, None)  # 12's successor is proposed: no bonus


class Grid(Draws):
    """Draws at a set point of [0, 1): the uniform of every position's SAMPLE draw."""

    def __init__(self, point: float):
        super().__init__(0)
        self.point = point

    def uniform(self, position, purpose):
        assert purpose == SAMPLE
        return self.point


class Target(NamedTuple):
    """The final head's output at some positions, when sampling: its logits [T, V] are read."""

    token: list[int]
    logits: torch.Tensor


P = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)


@pytest.mark.parametrize("proposed", [0, 1, 2, 3])
def test_sampled_verification_keeps_plain_samplings_draw(proposed):
    """Whatever is proposed after position 10, the token kept there is the one plain sampling draws with the same
    uniform (over a grid of n points): so its distribution is p exactly, and a proposal (a point mass on a token d)
    is accepted with probability p(d), as rejection sampling would."""
    n = 1000
    target = Target([0, 0], torch.log(P).reshape(1, -1).repeat(2, 1))  # p at positions 10 and 11 (temperature 1)
    sampler = Sampler(SamplingParams(temperature=1.0), None)
    kept, accepted_mass = torch.zeros(4, dtype=torch.float64), 0.0
    for i in range(n):
        sampler.draws = Grid((i + 0.5) / n)
        plain = sampler.draws.choice(P, 10, SAMPLE)
        accepted, token = verify(target, [0] * 10 + [3, proposed], 10, 12, False, sampler)
        kept_token = proposed if accepted == 1 else token
        assert kept_token == plain
        kept[kept_token] += 1 / n
        accepted_mass += accepted / n
    assert torch.allclose(kept, P, atol=2.0 / n), kept
    assert abs(accepted_mass - float(P[proposed])) <= 2.0 / n


def test_an_exit_heads_draw_takes_the_final_draws_uniform():
    """An exit head's proposal is drawn with the uniform of the final layer's draw at its position: where its
    distribution is the final layer's, it proposes that very token, and it is accepted."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3), None)
    logits = torch.log(P + 1e-12)
    for position in range(50):
        assert sampler.draw_exit(position, logits, reduced=False) == sampler.draws.choice(
            torch.softmax(logits.double(), 0), position, SAMPLE
        )


def test_sampled_verification_draws_the_bonus_token_from_p():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=4), None)
    target = Target([0], torch.log(P).reshape(1, -1))
    accepted, token = verify(target, [0] * 11, 10, 11, True, sampler)  # position 10 is the newest: no proposal
    assert accepted == 0 and token == sampler.draws.choice(P, 10, SAMPLE)
