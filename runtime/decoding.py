"""A request's calls: the subgraph calls every decoder makes (`DecodeContext`), the prefill, the final head's
choice, and ParaDecode's executor (`Executor`).

Plain decoding steps in an engine (runtime/engine.py) through a `DecodeContext`. ParaDecode of one request is an
`Executor` over its planner (runtime/planner.py: what each call computes) and proposers (runtime/proposers.py):
it makes the calls the planner plans, hands their results back, asks the exit heads for their proposals, judges
finished groups with `runtime.verification.verify` and keeps the KV cache's lengths (docs/design.md §3, §10).
`Executor.run` is a generator of verified tokens `(token, margin, stop)`: it takes the request's `Stops` (an EOS
token, `max_new_tokens`, the cache's end), decides after each token and ends after the one whose `stop` is not
None. Its caller applies what only text shows (stop strings) and closes the generator to stop it sooner.

Threading model: one thread per `Executor` and no lock; the `streams` and `both` overlaps, with side lanes beside
lane 0, are `ThreadedExecutor` (runtime/overlaps.py), whose docstring has their threading model.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from paradecode.graphs.errors import SchedulerStallError
from paradecode.graphs.tensors import (
    EMBEDDED,
    FEATURES,
    HIDDEN,
    HIDDEN_OUT,
    INPUT_IDS,
    LOGITS,
    MARGIN,
    PAST_KEY,
    PAST_VALUE,
    POSITIONS,
    PROB,
    TOKEN,
    of_layer,
)
from paradecode.runtime.backends.base import Backend
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.planner import Group, Planner, Step
from paradecode.runtime.proposers import DraftProposer, ExitHeads, LookupProposer
from paradecode.runtime.row_exactness import AS_IS, RowForm
from paradecode.runtime.sampling import SAMPLE, Draws, Sampler, SamplingParams, distribution
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationStats
from paradecode.runtime.stops import Stops
from paradecode.runtime.tracing import Timeline
from paradecode.runtime.verification import verify

MAIN = "main"
HEAD_OUTPUTS = (TOKEN, PROB, MARGIN)


@dataclass
class HeadOutput:
    """Top-1 token, its probability and the top-1/top-2 logit margin per position, as Python lists
    (the scheduler reads them one by one; lists are the cheapest form for that)."""

    token: list[int]
    prob: list[float]
    margin: list[float]
    logits: torch.Tensor | None = None  # [T, V] ([T, N] for a reduced-vocabulary exit head), when asked for

    @classmethod
    def joined(cls, outs: list[HeadOutput]) -> HeadOutput:
        """The outputs of consecutive positions' calls, as one call's."""
        logits = None if outs[0].logits is None else torch.cat([out.logits for out in outs])
        return cls(*([x for out in outs for x in getattr(out, f)] for f in ("token", "prob", "margin")), logits)

    @classmethod
    def of(cls, outputs: dict[str, torch.Tensor]) -> HeadOutput:
        """From a head's (or fused layer+exit's) outputs, [1, T] tensors on any device."""
        logits = outputs.get(LOGITS)
        if logits is not None:
            logits = logits.reshape(-1, logits.shape[-1]).cpu()
        return cls(*(outputs[name].reshape(-1).tolist() for name in HEAD_OUTPUTS), logits)


@dataclass
class DecodeContext:
    """The subgraph calls a decoder makes, each timed into the timeline (this is the hot path).

    Each method builds the call's feeds from the contract's tensor names and makes one
    `backend.run(name, feeds, lane)`.
    """

    backend: Backend
    cache: KVCache
    timeline: Timeline
    annotate: Callable[[str], AbstractContextManager] | None = field(default=None, kw_only=True)  # NVTX ranges
    # observe(subgraph, positions, seconds) after each call of lane 0 (positions: of every row, padding included):
    # adaptive speculation's cost estimates
    observe: Callable[[str, int, float], None] | None = field(default=None, kw_only=True)
    # How a call of one sequence's positions is padded (runtime/row_exactness.py); None: as this machine needs
    form: RowForm | None = field(default=None, kw_only=True)
    positions: torch.Tensor = field(init=False)  # [1, capacity + spare]: every call's positions are a slice of it

    def __post_init__(self) -> None:
        self.whole = False  # a prompt's prefill: its calls run whole whatever the form (plain decoding shares it)
        if self.form is None:
            self.form = self.backend.row_form or AS_IS  # no exact form: plain decoding (ParaDecode is refused)
        self.positions = torch.arange(self.cache.shape[2], dtype=torch.int64).unsqueeze(0)
        self.learned_positions = self.backend.spec.positions == "learned"
        # The layers whose outputs the draft head reads beside the last one's (a layer may be named twice), and each
        # one's index in the cache's features: every call that computes one of them keeps its outputs there (`keep`)
        self.feature_layers = self.backend.manifest.feature_layers
        self.feature_index = {layer: i for i, layer in enumerate(sorted(set(self.feature_layers)))}
        # The export's segments, first layer -> last: a run of layers one call computes (graphs/tensors.py); not one
        # that passes a feature layer before its last (only its last layer's outputs come out of it)
        self.segments = {
            sub.io.layer: sub.io.last
            for sub in self.backend.manifest.subgraphs
            if sub.io.kind == "segment" and not any(sub.io.layer <= f < sub.io.last for f in self.feature_index)
        }

    @property
    def num_layers(self) -> int:
        return self.backend.spec.num_layers

    def at(self, start: int, tokens: int) -> torch.Tensor:
        """The positions [1, tokens] of a call from `start` (a batch of requests has one row per request)."""
        return self.positions[:, start : start + tokens]

    def end(self, start: int, tokens: int) -> int:
        """One past the highest position of a call of `tokens` positions from `start`: the slots its cache needs."""
        return start + tokens

    def embed(self, lane: str, ids: list[int], start: int) -> torch.Tensor:
        end = start + len(ids)
        feeds = {INPUT_IDS: torch.tensor([ids], dtype=torch.int64)}
        if self.learned_positions:
            feeds[POSITIONS] = self.at(start, len(ids))
        return self._call(lane, "embed", "embed", start, end, feeds)[HIDDEN]

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states a call computes: each row's positions, then copies of its last at the positions after
        it as far as this machine's form says (`form`); the caller keeps `hidden`'s positions of what comes back."""
        batch, tokens = hidden.shape[:2]
        if self.form.alone:  # one position a call, or a prefill
            return hidden
        rows = self.form.tokens_per_row(batch, tokens)
        if rows == tokens:
            return hidden
        return torch.cat((hidden, hidden[:, -1:].expand(-1, rows - tokens, -1)), 1)

    def _layer_feeds(self, layer: int, hidden: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        self.cache.reserve(self.end(start, hidden.shape[1]))
        key, value = self.cache.layer(layer)
        return {HIDDEN: hidden, POSITIONS: self.at(start, hidden.shape[1]), PAST_KEY: key, PAST_VALUE: value}

    def alone(self, hidden: torch.Tensor) -> bool:
        """Whether this call's positions run in calls of their own (a form of `alone`; never a prefill's)."""
        return self.form.alone and not self.whole and hidden.shape[0] == 1 and hidden.shape[1] > 1

    @contextlib.contextmanager
    def prompt(self):
        """The calls inside run whole, whatever the form: a prompt's prefill, which plain decoding shares."""
        self.whole = True
        try:
            yield
        finally:
            self.whole = False

    def layer(self, lane: str, layer: int, hidden: torch.Tensor, start: int) -> torch.Tensor:
        if self.alone(hidden):
            return torch.cat([self.layer(lane, layer, hidden[:, i : i + 1], start + i) for i in _each(hidden)], 1)
        rows = self.rows(hidden)
        feeds = self._layer_feeds(layer, rows, start)
        out = self._call(lane, f"layer_{layer}", f"layer {layer}", start, start + hidden.shape[1], feeds)
        return self.keep(layer, _kept(out, hidden, rows)[HIDDEN_OUT], start)

    def keep(self, layer: int, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """`hidden`, layer `layer`'s outputs at the call's positions, kept in the cache's features where the draft
        head reads that layer's (and the cache holds features: not a row-form probe's, runtime/row_exactness.py)."""
        index = self.feature_index.get(layer)
        if index is not None and self.cache.features:
            rows = torch.arange(hidden.shape[0])[:, None]
            self.cache.feature(index)[rows, self.at(start, hidden.shape[1])] = hidden
        return hidden

    def features(self, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """The feature layers' outputs at `hidden`'s positions (the last layer's outputs at start..) beside them:
        [B, T, 3D], what the draft head's map reads."""
        positions = self.at(start, hidden.shape[1])
        rows = torch.arange(hidden.shape[0])[:, None]
        kept = [self.cache.feature(self.feature_index[layer])[rows, positions] for layer in self.feature_layers]
        return torch.cat([*kept, hidden], dim=-1)

    def layers(self, lane: str, first: int, last: int, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Layers first..last of `hidden`'s positions: a segment's one call wherever one covers a run of them, the
        layer graphs for the rest."""
        layer = first
        while layer <= last:
            end = self.segments.get(layer)
            if end is not None and end <= last:
                hidden = self.segment(lane, layer, end, hidden, start)
                layer = end + 1
            else:
                hidden = self.layer(lane, layer, hidden, start)
                layer += 1
        return hidden

    def segment(self, lane: str, first: int, last: int, hidden: torch.Tensor, start: int) -> torch.Tensor:
        if self.alone(hidden):
            rows = [self.segment(lane, first, last, hidden[:, i : i + 1], start + i) for i in _each(hidden)]
            return torch.cat(rows, 1)
        rows = self.rows(hidden)
        feeds = {HIDDEN: rows, POSITIONS: self.at(start, rows.shape[1])}
        self.cache.reserve(self.end(start, rows.shape[1]))
        for layer in range(first, last + 1):
            feeds[of_layer(PAST_KEY, layer)], feeds[of_layer(PAST_VALUE, layer)] = self.cache.layer(layer)
        name, label = f"segment_{first}_{last}", f"layers {first}-{last}"
        out = self._call(lane, name, label, start, start + hidden.shape[1], feeds, (HIDDEN_OUT,))
        return self.keep(last, _kept(out, hidden, rows)[HIDDEN_OUT], start)

    def layer_exit(self, lane: str, layer: int, hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, HeadOutput]:
        if self.alone(hidden):  # the head reads the last position: the last call's
            outs = [self.layer_exit(lane, layer, hidden[:, i : i + 1], start + i) for i in _each(hidden)]
            return torch.cat([out for out, _ in outs], 1), outs[-1][1]
        rows = self.rows(hidden)
        feeds = self._layer_feeds(layer, rows, start)
        name, label = f"layer_exit_{layer}", f"layer {layer} + exit head"
        out = _kept(self._call(lane, name, label, start, start + hidden.shape[1], feeds), hidden, rows)
        return self.keep(layer, out[HIDDEN_OUT], start), HeadOutput.of(out)

    def draft(
        self, lane: str, layer: int, hidden: torch.Tensor, embedded: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, HeadOutput]:
        """The draft head (graphs/tensors.py `draft`) over the last layer's outputs `hidden` at positions start - 1..
        and the embeddings `embedded` of the tokens at start..: its outputs and guesses, its rows written into the
        cache's layer `layer`. Its calls run as they come, whatever the form: its guesses are verified, never kept."""
        tokens = hidden.shape[1]
        self.cache.reserve(self.end(start, tokens))
        key, value = self.cache.layer(layer)
        feeds = {HIDDEN: hidden, EMBEDDED: embedded, POSITIONS: self.at(start, tokens), PAST_KEY: key}
        feeds[PAST_VALUE] = value
        out = self._call(lane, "draft", "draft head", start, start + tokens, feeds)
        return out[HIDDEN_OUT], HeadOutput.of(out)

    def draft_reduce(self, lane: str, hidden: torch.Tensor, start: int) -> torch.Tensor:
        """What the draft head's call over positions start.. reads where it reads three layers' outputs: its map
        (graphs/tensors.py `draft_reduce`) of the feature layers' outputs and the last one's, `hidden`, at positions
        start - 1.. (the cache's features hold theirs)."""
        feeds = {FEATURES: self.features(hidden, start - 1)}
        return self._call(lane, "draft_reduce", "draft head's map", start, start + hidden.shape[1], feeds)[HIDDEN]

    def head(self, lane: str, name: str, hidden: torch.Tensor, start: int, logits: bool = False) -> HeadOutput:
        """A head's top-1 token, probability and margin per position; with `logits`, its logits too (sampling)."""
        outputs = (*HEAD_OUTPUTS, LOGITS) if logits else HEAD_OUTPUTS
        if self.alone(hidden):
            return HeadOutput.joined(
                [self.head(lane, name, hidden[:, i : i + 1], start + i, logits) for i in _each(hidden)]
            )
        rows = self.rows(hidden)
        out = self._call(lane, name, name, start, start + hidden.shape[1], {HIDDEN: rows}, outputs)
        return HeadOutput.of(_kept(out, hidden, rows))

    def _call(
        self, lane: str, name: str, label: str, start: int, end: int, feeds: dict, outputs=None
    ) -> dict[str, torch.Tensor]:
        """`backend.run(name, feeds, lane)`, timed into the timeline; inside an NVTX-style range while profiling."""
        if self.annotate is None:
            return self._timed(lane, name, start, end, feeds, outputs)
        with self.annotate(f"{label} pos {start}-{end - 1} lane {lane}"):
            return self._timed(lane, name, start, end, feeds, outputs)

    def _timed(self, lane: str, name: str, start: int, end: int, feeds: dict, outputs) -> dict[str, torch.Tensor]:
        began = time.perf_counter()
        out = self.backend.run(name, feeds, lane, outputs)
        ended = time.perf_counter()
        self.timeline.add(lane, name, began, ended, (start, end))
        if self.observe is not None and lane == MAIN:
            rows, tokens = next(iter(feeds.values())).shape[:2]  # every row's positions: what the call computed
            self.observe(name, rows * tokens, ended - began)
        return out

    def phase(self, name: str, positions: tuple[int, int]):
        """A scheduler phase (prefill, verify, rollback): an NVTX range and a span, only while profiling."""
        if self.annotate is None:
            return contextlib.nullcontext()
        return self._phase(name, positions)

    @contextlib.contextmanager
    def _phase(self, name: str, positions: tuple[int, int]):
        began = time.perf_counter()
        with self.annotate(name):
            yield
        self.timeline.add("phases", name, began, time.perf_counter(), positions)


class RowsContext(DecodeContext):
    """The calls over every row of a cache of several sequences (a batch, runtime/engine.py), each row at positions
    of its own: row b's positions are `starts[b] .. starts[b] + T - 1` (`begin`), so rows of every length share a
    call (the layers mask by position)."""

    starts: torch.Tensor  # [B, 1]: each row's first position in the next calls
    last: int  # the highest of them

    def begin(self, starts: list[int]) -> None:
        """The next calls' rows start at `starts` (one per row)."""
        self.starts = torch.tensor(starts, dtype=torch.int64)[:, None]
        self.last = max(starts)

    def at(self, start: int, tokens: int) -> torch.Tensor:
        return self.starts + self.positions[:, :tokens]

    def end(self, start: int, tokens: int) -> int:
        return self.last + tokens

    def embed_rows(self, ids: list[list[int]]) -> torch.Tensor:
        """The rows' tokens (each row the same number) embedded at their positions."""
        tokens = len(ids[0])
        feeds = {INPUT_IDS: torch.tensor(ids, dtype=torch.int64)}
        if self.learned_positions:
            feeds[POSITIONS] = self.at(0, tokens)
        first = int(self.starts.min())
        return self._call(MAIN, "embed", "embed", first, self.last + tokens, feeds)[HIDDEN]


def _each(hidden: torch.Tensor) -> range:
    return range(hidden.shape[1])


def _kept(outputs: dict[str, torch.Tensor], hidden: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """A call's outputs for `hidden`'s positions: the copies' rows (`DecodeContext.rows`) dropped."""
    if rows is hidden:
        return outputs
    per_position = (HIDDEN_OUT, *HEAD_OUTPUTS, LOGITS)  # [B, T, ...]; not the caches, written in place
    return {name: value[:, : hidden.shape[1]] if name in per_position else value for name, value in outputs.items()}


def choose(out: HeadOutput, index: int, position: int, sampling: SamplingParams | None, draws: Draws | None) -> int:
    """The token the final head gives position `position` (out's `index`-th): its top-1 when greedy, else a
    draw from its distribution keyed by the position."""
    if sampling is None:
        return out.token[index]
    return draws.choice(distribution(out.logits[index], sampling), position, SAMPLE)


def prefill(
    ctx: DecodeContext,
    prompt: list[int],
    sampling: SamplingParams | None = None,
    draws: Draws | None = None,
    draft: DraftProposer | None = None,
) -> tuple[int, float]:
    """The whole prompt in one call per layer; the final head on its last position gives the first token. `draft`:
    handed the last layer's outputs of the prompt's positions (each one's successor is then verified)."""
    with ctx.phase("prefill", (0, len(prompt))), ctx.prompt():
        hidden = ctx.layers(MAIN, 1, ctx.num_layers, ctx.embed(MAIN, prompt, 0), 0)
        for layer in range(1, ctx.num_layers + 1):
            ctx.cache.written(layer, len(prompt))
        out = ctx.head(MAIN, "final", hidden[:, -1:], len(prompt) - 1, logits=sampling is not None)
    if draft is not None:
        draft.verified(0, hidden)
    return choose(out, 0, len(prompt) - 1, sampling, draws), out.margin[0]


# --- ParaDecode ----------------------------------------------------------------------------------------------------
def _join(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Two consecutive groups' hidden states [1, T, D] as one group's."""
    return torch.cat([before, after], dim=1)


class Executor:
    """ParaDecode on lane 0 alone: each step computes the group the planner names as far as it can go, through
    `ctx`; a pending group's remaining layers run in the frontier's own calls once it reaches their depth (the two
    groups merge). One thread, no lock: `ThreadedExecutor` (runtime/overlaps.py) adds side lanes."""

    def __init__(
        self,
        ctx: DecodeContext,
        prompt: list[int],
        stops: Stops,
        planner: Planner,
        exits: ExitHeads,
        sampler: Sampler | None,
        draft: DraftProposer | None = None,
    ):
        self.ctx = ctx
        self.draft = draft  # handed the last layer's outputs of verified positions
        self.prompt = list(prompt)
        self.stops = stops
        self.planner = planner
        self.exits = exits
        self.sampler = sampler  # None: greedy
        self.logits = sampler is not None  # the heads' logits are needed (sampling)
        self.L = ctx.num_layers
        self.sync = ctx.backend.device.type == "cuda"  # publish GPU results only once their stream is done

    @classmethod
    def of(
        cls,
        ctx: DecodeContext,
        prompt: list[int],
        stops: Stops,
        stats: GenerationStats,
        *,
        thresholds: dict[int, float],
        max_unverified: int,
        merge: bool,
        lookup: LookupProposer | None = None,
        draft: DraftProposer | None = None,
        sampler: Sampler | None = None,
        speculation: Speculation | None = None,
        exit_policy=None,
        **executor,
    ) -> Executor:
        """ParaDecode of one request over `ctx` after `prompt`, until `stops` say so, counting into `stats`: its
        planner and proposers, and this executor over them (`executor`: a subclass's own arguments).

        `thresholds`: per exit layer (above 1: never); `max_unverified`: K; `merge`: a pending group's remaining
        layers join the frontier's calls (`batched`, `both`); `lookup`: the request's lookup proposer (None: off);
        `draft`: its draft head's (None: off), asked where lookup has nothing;
        `sampler`: None is greedy; `speculation`: adaptive speculation's estimates (None: always exit and propose);
        `exit_policy`: replaces the threshold test (`Tracing`)."""
        exits = ExitHeads(thresholds, ctx.backend.subgraph_names, sampler, exit_policy)
        planner = Planner(
            prompt,
            num_layers=ctx.num_layers,
            exits=exits,
            max_unverified=max_unverified,
            merge=merge,
            last_position=stops.last_position - 1,
            eos=stops.eos,
            stats=stats,
            lookup=lookup,
            draft=None if draft is None else functools.partial(draft.propose, ctx),
            draft_tokens=0 if draft is None else draft.max_tokens,
            speculation=speculation,
            join=_join,
        )
        return cls(ctx, prompt, stops, planner, exits, sampler, draft=draft, **executor)

    # --- the generator lane 0 runs ------------------------------------------------------------------------------------
    def run(self, resume: int | None = None) -> Iterator[tuple[int, float, str | None]]:
        """The verified tokens after the prompt, the first from its prefill, each with the stop decision after it
        (`Stops`): it ends after the one that stops. `resume`: the prompt is already in the cache at every layer (an
        engine hands a request back to ParaDecode) and `resume` is the token after it, verified and already
        returned: decoding goes on from there, yielding only the tokens after it."""
        planner, n = self.planner, len(self.prompt)
        if resume is None:
            sampler = self.sampler
            params, draws = (sampler.params, sampler.draws) if sampler is not None else (None, None)
            token, margin = prefill(self.ctx, self.prompt, params, draws, self.draft)
        else:
            token = resume
            for layer in range(1, self.L + 1):
                self.ctx.cache.written(layer, n)
        planner.begin(token)
        position = n  # the newest verified token's
        if resume is None:
            stop = self.stops.after(token, position)
            yield token, margin, stop
            if stop is not None:
                return
        planner.start_frontier(n, token)
        self.start_side_lanes()
        failed = False
        try:
            while True:
                for token, margin in self.verify_finished():
                    position += 1
                    stop = self.stops.after(token, position)
                    yield token, margin, stop
                    if stop is not None:
                        return  # nothing after it was started (the planner's `start_frontier`, `propose`, `settle`)
                self.step()
        except BaseException:  # closing early (GeneratorExit) included: the stop below must not mask it
            failed = True
            raise
        finally:
            self.stop_side_lanes(raise_errors=not failed)

    def step(self) -> None:
        """Compute the planner's next step (`Planner.next_step`) and hand it the results."""
        step = self.plan()
        if step is None:
            return
        group, last, exit_now, fused = step
        ctx, start, end, depth, hidden = self.ctx, group.start, group.end, group.depth, group.hidden
        first, final, early = depth + 1, None, None
        if depth == -1:
            hidden, depth, first = ctx.embed(MAIN, self.planner.tokens[start:end], start), 0, 1
        if depth < last - fused:  # the layers before: segments where they cover them, else one call each
            hidden, depth = ctx.layers(MAIN, depth + 1, last - fused, hidden, start), last - fused
        if fused and depth < last:  # the exit layer in one call with its head
            hidden, early = ctx.layer_exit(MAIN, last, hidden, start)
            depth = last
        if depth == self.L:
            final = ctx.head(MAIN, "final", hidden, start, logits=self.logits)
        self.publish()
        self.computed(group, first, depth, hidden, final)
        if exit_now and depth == last:
            if early is None:
                early = ctx.head(MAIN, self.exits.head[last], hidden[:, -1:], end - 1, logits=self.logits)
            self.exited(group, last, self.exits.propose(end - 1, last, early))

    def plan(self) -> Step | None:
        step = self.planner.next_step()
        if step is None:  # only a side lane could advance a group, and there is none
            raise SchedulerStallError(
                f"the ParaDecode scheduler has nothing to compute (groups: {self.describe()}). This is a bug: "
                "please report it with the settings used."
            )
        return step

    def computed(self, group: Group, first: int, depth: int, hidden: torch.Tensor, final: HeadOutput | None) -> None:
        """`group` computed layers first..depth: the cache holds them, the planner has the result."""
        for layer in range(first, depth + 1):
            self.ctx.cache.written(layer, group.end)
        self.planner.computed(group, depth, hidden, final)

    def exited(self, group: Group, layer: int, token: int | None) -> None:
        self.planner.exit_proposed(group, layer, token)

    def publish(self) -> None:
        """On a GPU, wait for this lane's stream so another lane may read what it computed (lane 0
        alone waits too, as it always has: whether it can skip that is not measured)."""
        if self.sync:
            torch.cuda.current_stream().synchronize()

    # --- verdicts -----------------------------------------------------------------------------------------------------
    def verify_finished(self) -> list[tuple[int, float]]:
        """Verify, in position order, every group that has its final head's output; roll back on a rejection."""
        verified: list[tuple[int, float]] = []
        planner, ctx = self.planner, self.ctx
        while (group := planner.take_verifiable()) is not None:
            if ctx.annotate is not None:
                now = time.perf_counter()
                ctx.timeline.add("phases", "verify", now, now, (group.start, group.end))
            bonus = planner.wants_successor(group)
            accepted, token = verify(group.final, planner.tokens, group.start, group.end, bonus, self.sampler)
            if self.draft is not None:  # positions whose successors are now verified, before the next proposal
                self.draft.verified(group.start, group.hidden[:, : min(accepted + 1, group.end - group.start)])
            position = planner.settle(group, accepted, token, verified)
            if position >= 0:
                with ctx.phase("rollback", (position + 1, len(planner.tokens))):
                    self.rollback(position, token)
                verified.append((token, group.final.margin[accepted]))
                return verified
        return verified

    def rollback(self, position: int, token: int) -> None:
        """tokens[position + 1] was wrong: the planner continues from `token`, the cache forgets the later positions."""
        self.planner.rollback(position, token)
        self.discard_in_flight()
        self.ctx.cache.rollback(position + 1)

    def discard_in_flight(self) -> None:
        """Make sure no call of a discarded position is still to land (none: every call here has)."""

    def describe(self) -> str:
        return ", ".join(f"{g.start}-{g.end - 1}@{g.depth}{' busy' if g.busy else ''}" for g in self.planner.groups)

    # --- side lanes: none here ----------------------------------------------------------------------------------------
    def start_side_lanes(self) -> None:
        pass

    def stop_side_lanes(self, *, raise_errors: bool) -> None:
        pass
