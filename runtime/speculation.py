"""Speculation that pays for itself: exit and propose only while this export, on this machine, gains by it.

ParaDecode's two sources of early tokens, exit heads and prompt lookup, each cost something whether or not
their token is accepted: an exit head's call, extra positions in the layers' and the final head's calls, and
on a rejected exit the successor's work. What an accepted token saves depends on those same costs, which
differ by export and machine (SmolLM2's quantized export on a 2-core CPU: a layer call of 2 positions costs
1.65x one of 1, the float export's 1.07x). So the decoder measures both as it goes and turns a source off
while its expected gain is negative:

- **Costs** (`CallTimes`): every subgraph call the decoder makes is timed already (`DecodeContext`); a layer's
  time at one position, what each further position adds to a layer call and to the final head's, and each exit
  head's time, as decayed averages, are learned from those timings.
- **Acceptance** (`Rate`): per exit layer, the share of head calls whose token exits and the share of exits
  the final layer accepts; for lookup, the share of proposed tokens accepted. Decayed averages too, so they
  follow the text being written.
- **The decision**, in seconds per opportunity, the batched form of the cost model of `export/heads/cost_model.py`
  (one lane: an accepted early token's upper layers share the successor's calls):

      exit at layer e:  P(exit) * (saved_e - P(reject) * lost) - head_e  > 0
          saved_e = (L - e) * (layer - merge) + (final - final_merge)   what an accepted exit saves
          lost    = L * layer + final       what a rejection adds: its discarded successor's work
      (a rejected exit still costs what an accepted one does, plus `lost`: export/heads/cost_model.py's per_token)
      lookup, the d-th token of a proposal:
                        P(tokens 1..d all accepted) * (L * layer + final) - (L * merge + final_merge)  > 0

  A proposal's tokens are not alike: the d-th is judged only if the ones before it were accepted, and how
  often that holds falls with d (a copied passage ends somewhere). So acceptance is learned per depth d, as the
  share of d-th tokens accepted among those judged, and a proposal keeps its longest prefix whose last token
  still pays (SuffixDecoding's proposal length adapted to what the match supports, in cost-model form).

  the draft head's d-th guess, drafted before any is verified (its call is paid whether or not the guesses
  before it are accepted):
                        P(guesses 1..d all accepted) * (L * layer + final) - (L * merge + final_merge) - draft  > 0

  where `draft` is a draft call's time at one position; the chain drafted is the longest whose last guess pays,
  none where the first does not (then the draft head is not called at all).

  A source that does not pay is still tried at every EXPLORE-th opportunity, so its estimate can recover
  when the text changes. Decisions never change which tokens are verified: every early token is checked by
  the final layer as before, so greedy output is plain decoding's whatever is decided.

Timing-dependent decisions would make a seeded sampled run unrepeatable, so the decoder adapts greedy
decoding only (GenerationConfig.adaptive). The estimates live with the loaded model and carry over from one
request to the next, as a service's would.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from paradecode.runtime.stats import DRAFT, LOOKUP

DECAY = 0.97  # weight of the estimate so far at each new observation: about the last 30 events count
EXPLORE = 16  # a source that does not pay is still tried once every EXPLORE opportunities
PRIOR_MERGE = 0.1  # what one more position adds to a layer or final head call, as a share of it, until measured
LEARN_TOKENS = 64  # calls of more positions (a long prefill) say little of a step's (a batch of 8 rows of 6: 48)
OUTLIER = 3.0  # an observation is clipped to this many times the estimate (a preempted call on a shared CPU)
CALL_NAMES = re.compile(r"(layer|exit|layer_exit)_(\d+)|segment_(\d+)_(\d+)|final|embed|draft")


@dataclass
class Average:
    """A decayed average: recent observations weigh most."""

    value: float | None = None

    def add(self, x: float) -> None:
        if self.value is None:
            self.value = x
        else:
            self.value = DECAY * self.value + (1 - DECAY) * min(x, OUTLIER * self.value)


@dataclass
class Rate:
    """A decayed share of successes, starting from `prior` successes in `weight` tries."""

    prior: float
    weight: float = 4.0
    hits: float = 0.0
    tries: float = 0.0

    def add(self, hit: bool) -> None:
        self.hits = DECAY * self.hits + hit
        self.tries = DECAY * self.tries + 1

    @property
    def value(self) -> float:
        return (self.hits + self.prior * self.weight) / (self.tries + self.weight)


@dataclass
class CallTimes:
    """Seconds per call, learned from the decoder's own calls: a layer at one position, what each further
    position adds to a layer call and to the final head's, the final head at one position, each exit head."""

    layer: Average = field(default_factory=Average)
    layer_extra: Average = field(default_factory=Average)
    final: Average = field(default_factory=Average)
    final_extra: Average = field(default_factory=Average)
    exit_head: dict[int, Average] = field(default_factory=dict)
    draft: Average = field(default_factory=Average)  # the draft head's call at one position (a chain's step)
    seen: set[str] = field(default_factory=set)  # subgraphs called at least once (the first call is not learned)

    def observe(self, name: str, tokens: int, seconds: float) -> None:
        """One call of subgraph `name` over `tokens` positions took `seconds`. A subgraph's first call (which may
        create its session) and calls of more than LEARN_TOKENS positions are not learned from."""
        if name not in self.seen:
            self.seen.add(name)
            return
        match = CALL_NAMES.fullmatch(name)
        if match is None or tokens > LEARN_TOKENS:
            return
        kind, number, first, last = match.groups()
        if name == "final":
            self._by_positions(self.final, self.final_extra, tokens, seconds)
        elif name == "draft":
            if tokens == 1:
                self.draft.add(seconds)
        elif kind == "exit":
            self.exit_head.setdefault(int(number), Average()).add(seconds)
        elif kind == "layer":
            self._by_positions(self.layer, self.layer_extra, tokens, seconds)
        elif first is not None:  # a segment: per layer
            self._by_positions(self.layer, self.layer_extra, tokens, seconds / (int(last) - int(first) + 1))
        elif kind == "layer_exit" and self.layer.value is not None and tokens == 1:
            # a layer and its exit head in one call: the head's share is what the call adds to a layer's
            self.exit_head.setdefault(int(number), Average()).add(max(0.0, seconds - self.layer.value))

    @staticmethod
    def _by_positions(one: Average, extra: Average, tokens: int, seconds: float) -> None:
        if tokens == 1:
            one.add(seconds)
        elif one.value is not None:
            extra.add(max(0.0, seconds - one.value) / (tokens - 1))

    @property
    def known(self) -> bool:
        return self.layer.value is not None and self.final.value is not None

    def merge(self) -> float:
        return self.layer_extra.value if self.layer_extra.value is not None else PRIOR_MERGE * self.layer.value

    def final_merge(self) -> float:
        return self.final_extra.value if self.final_extra.value is not None else PRIOR_MERGE * self.final.value


@dataclass
class ExitRates:
    """At one exit layer: the share of head calls whose token exits, and of exits the final layer accepts."""

    exits: Rate = field(default_factory=lambda: Rate(prior=0.5))
    accepted: Rate = field(default_factory=lambda: Rate(prior=0.8))


class Speculation:
    """What the decoder has measured of this model's costs and acceptance, and the decisions from them.
    One per loaded model, so it carries over between requests; the engines decoding at once update it together.

    Threading model: every engine of a model (threads of their own) observes and asks at once. `_lock` guards every
    update (`observe`, `head_called`, `verified` and the exploration counts the decisions keep); a decision reads
    the estimates without it, so it may read one that a concurrent update is changing, which only shifts a
    speculation decision, never an output."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.times = CallTimes()
        self.exit_rates: dict[int, ExitRates] = {}
        self.lookup_rate = Rate(prior=0.5)  # every proposed token, discarded ones as rejected (reported)
        # [d - 1]: of the d-th tokens of proposals that were judged (the ones before accepted), the share accepted
        self.lookup_depth: list[Rate] = []
        self.draft_rate = Rate(prior=0.5)  # every token a draft head proposed, discarded ones as rejected (reported)
        self.draft_depth: list[Rate] = []  # as lookup_depth, of the draft head's guesses
        self._skipped: dict[object, int] = {}  # source -> opportunities passed up since its last try
        self._lock = threading.Lock()

    # --- what happened ------------------------------------------------------------------------------------
    def observe(self, name: str, positions: int, seconds: float) -> None:
        """A call of subgraph `name` over `positions` positions (every row's) took `seconds` (`CallTimes`)."""
        with self._lock:
            self.times.observe(name, positions, seconds)

    def head_called(self, layer: int, exited: bool) -> None:
        with self._lock:
            self.exit_rates.setdefault(layer, ExitRates()).exits.add(exited)

    def verified(self, source: int, accepted: bool, depth: int | None = None) -> None:
        """The final layer's verdict on a token proposed by exit layer `source`, or by lookup (LOOKUP) or the draft
        head (DRAFT): then `depth` is its place in its proposal (1: the first; None: discarded unjudged, after a
        rejection)."""
        with self._lock:
            if source == LOOKUP:
                self.lookup_rate.add(accepted)
                if depth is not None:
                    self._depth_rate(depth).add(accepted)
            elif source == DRAFT:
                self.draft_rate.add(accepted)
                if depth is not None:
                    self._depth_rate(depth, self.draft_depth).add(accepted)
            else:
                self.exit_rates.setdefault(source, ExitRates()).accepted.add(accepted)

    # --- decisions ------------------------------------------------------------------------------------------
    def exit_gain(self, layer: int, head_is_final: bool = False) -> float | None:
        """Expected seconds saved by calling exit layer `layer`'s head for a token (None: costs not known yet).
        `head_is_final`: the layer's head is the final head's graph (an export without trained heads)."""
        t = self.times
        if not t.known:
            return None
        rates = self.exit_rates.setdefault(layer, ExitRates())
        layer_s, final_s = t.layer.value, t.final.value
        saved = (self.num_layers - layer) * (layer_s - t.merge()) + (final_s - t.final_merge())
        lost = self.num_layers * layer_s + final_s
        head = t.exit_head.get(layer)
        if head_is_final:
            head_s = final_s
        else:
            head_s = head.value if head is not None and head.value is not None else 0.0
        return rates.exits.value * (saved - (1 - rates.accepted.value) * lost) - head_s

    def _depth_rate(self, depth: int, rates: list[Rate] | None = None) -> Rate:
        """The rate of depth `depth` in `rates` (default: lookup's), made (with the ones before it) at its first
        verdict."""
        rates = self.lookup_depth if rates is None else rates
        while len(rates) < depth:
            rates.append(Rate(prior=self._depth_prior(len(rates) + 1)))
        return rates[depth - 1]

    @staticmethod
    def _depth_prior(depth: int) -> float:
        # the first token of a proposal: as likely as not; a later one follows accepted ones, so more likely
        return 0.5 if depth == 1 else 0.7

    def lookup_length(self, count: int) -> int | None:
        """How many of `count` proposed tokens are expected to pay: the longest prefix whose last token, reached
        and accepted with the product of the depth rates, saves more than its position adds to the calls (None:
        costs not known yet)."""
        if not self.times.known:
            return None
        return self._paying(count, self.lookup_depth, 0.0)

    def draft_length(self, count: int) -> int | None:
        """How many of up to `count` draft-head guesses are expected to pay, drafting included: the longest chain
        whose last guess, reached and accepted with the product of the draft's depth rates, saves more than its
        position adds to the calls and its own draft call costs (None: costs not known yet)."""
        if not self.times.known or self.times.draft.value is None:
            return None
        return self._paying(count, self.draft_depth, self.times.draft.value)

    def _paying(self, count: int, rates: list[Rate], cost: float) -> int:
        """The longest of `count` proposals whose last, reached and accepted with the product of `rates` (a depth's
        prior where it has none yet), saves more than its position adds to the calls and `cost` (seconds)."""
        t = self.times
        token = self.num_layers * t.layer.value + t.final.value
        extra = self.num_layers * t.merge() + t.final_merge() + cost
        reached, paying = 1.0, 0
        for depth in range(1, count + 1):
            reached *= rates[depth - 1].value if depth <= len(rates) else self._depth_prior(depth)
            if reached * token <= extra:
                break
            paying = depth
        return paying

    def lookup_tokens(self, count: int) -> int:
        """How many of `count` proposed tokens to propose: `lookup_length`, but every EXPLORE-th proposal that
        would be cut is proposed whole, so the rates of the depths cut off can recover when the text changes.
        (Only cuts count towards that: short proposals in between, proposed whole anyway, do not delay it.)"""
        return self._explored("lookup", count, self.lookup_length(count))

    def draft_tokens(self, count: int) -> int:
        """How many guesses to ask the draft head for, of up to `count`: `draft_length`, explored as
        `lookup_tokens` is."""
        return self._explored("draft", count, self.draft_length(count))

    def _explored(self, source: str, count: int, paying: int | None) -> int:
        """`paying` of `count` (all where not known), but `count` at every EXPLORE-th cut of `source`'s."""
        if paying is None or paying >= count:
            return count
        with self._lock:
            cut = self._skipped.get(source, 0) + 1
            self._skipped[source] = 0 if cut >= EXPLORE else cut
        return count if cut >= EXPLORE else paying

    def try_exit(self, layer: int, head_is_final: bool = False) -> bool:
        return self._worth(("exit", layer), self.exit_gain(layer, head_is_final))

    def _worth(self, source: object, gain: float | None) -> bool:
        with self._lock:
            if gain is None or gain > 0:
                self._skipped[source] = 0
                return True
            skipped = self._skipped.get(source, 0) + 1
            if skipped >= EXPLORE:
                self._skipped[source] = 0
                return True  # explore: the estimate must see the source now and then to recover
            self._skipped[source] = skipped
            return False

    def batch_proposals(self, available: list[int], sources: list[int] | None = None) -> int:
        """How many proposed tokens each row of a batch step may take, its rows having `available` proposals each
        (from `sources`: LOOKUP or DRAFT, each row's; all lookup's where not given): a call carries as many positions
        on every row as on its fullest (the others padded), so a step of B rows taking k costs B (k + 1) positions,
        and yields B tokens plus each row's accepted proposals. The k (at most the most available) with the most
        tokens per second expected from the costs and each row's source's depth rates; with costs not known yet,
        every proposal, and every EXPLORE-th step that would cut, every proposal too, so the rates of the depths cut
        off can recover.

            rows of a batch of 8 with available [5, 0, 0, 0, 0, 0, 0, 0] take fewer than the same row alone
            would ([5]): its 5 proposals would pad 7 other rows to 6 positions each."""
        most = max(available, default=0)
        t = self.times
        if not most or not t.known:
            return most
        rows, layers = len(available), self.num_layers
        sources = sources or [LOOKUP] * rows

        def cost(positions: int) -> float:
            extra = positions - 1
            return layers * (t.layer.value + extra * t.merge()) + t.final.value + extra * t.final_merge()

        def reach(rates: list[Rate]) -> list[float]:  # reach[n]: the accepted tokens expected of n proposals
            out, reached = [0.0], 1.0
            for depth in range(1, most + 1):
                reached *= rates[depth - 1].value if depth <= len(rates) else self._depth_prior(depth)
                out.append(out[-1] + reached)
            return out

        reaches = {source: reach(self.draft_depth if source == DRAFT else self.lookup_depth) for source in set(sources)}
        best, best_rate = 0, rows / cost(rows)
        for k in range(1, most + 1):
            accepted = sum(reaches[source][min(k, a)] for a, source in zip(available, sources, strict=True))
            rate = (rows + accepted) / cost(rows * (k + 1))
            if rate > best_rate:
                best, best_rate = k, rate
        if best >= most:
            return most
        with self._lock:
            cut = self._skipped.get("batch", 0) + 1
            self._skipped["batch"] = 0 if cut >= EXPLORE else cut
        return most if cut >= EXPLORE else best
