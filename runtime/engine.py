"""The engine: steps the requests (`Sequence`s) that share one KV cache, over one loaded model's runtime.

Every decode goes through an `Engine`: `model.generate` and `model.stream` run one of one row, a server's replica
one of `--max-batch` rows (continuous batching). An engine takes a `Runtime`, what every request of a loaded model
shares and none changes (the backend, the tokenizer, the shared estimates and lookup index behind their own
interfaces), and never the model; a `Sequence` holds everything of one request, made from its resolved `Request`
(runtime/request.py); an engine holds the cache its sequences decode in, each in a row of its own ([rows, H_kv, S,
D_h] per layer). Rows 0..n-1 are the sequences in the engine: when one leaves, the last one moves into its row (one
copy of the positions it holds), so every call takes one view of the cache's first n rows, never a gather.

One `step` gives every sequence its next verified tokens, in one of two ways:

- **Alone** (one `paradecode` sequence, nothing waiting for a row): it decodes with ParaDecode's executor
  (runtime/decoding.py: its planner, exit heads where they pay, lookup), one verified token per step, as it would
  in an engine of its own. When another request joins, its executor is closed after its newest verified token and
  the row goes on in the batched steps from there (the cache holds every position before that token at every
  layer; what it held beyond is overwritten); when the others leave, a new executor takes the row over from its
  newest token (`Executor.run(resume=...)`), without a prefill.
- **Together** (otherwise: several sequences, or plain decoding): every sequence's newest token, and for a
  `paradecode` sequence its lookup proposals, go through every layer in one call per segment (runtime/batch.py):
  each row at its own positions (a row's cache length is its position, and attention masks by position, so rows
  of every length share a call), every row with as many positions as the fullest (the others padded with copies),
  then the final head verifies each row's proposals (`runtime.verification.verify`): each row takes its accepted
  proposals and the token after them. How many proposals a row may take adapts to the batch
  (`Speculation.batch_proposals`): a call's extra positions cost every row, so fewer as the batch fills. Where the
  machine's row form says a call of several sequences computes a row otherwise than the sequence alone
  (`RowForm.rows_alone`, runtime/row_exactness.py: float-activation layers), each row's newest token goes through
  calls of its own row instead.

Either way a sequence's tokens are the ones it gets decoded alone, greedy or sampled (verification keeps plain
decoding's tokens, and a position's bits do not depend on its call: docs/design.md §3, §9).

A joining request is prefilled alone in its row (batch 1, its whole prompt at once) before the next step. Each
sequence stops by the same rules however it decodes (its `Stops`, decided by the engine for its rows and by its
executor while alone, and its `Completion`'s stop strings). A sequence's `timeline` records the calls made for it
alone (its prefill, its steps alone); a batched call of several rows is recorded in the engine's.

Threading: an engine is stepped by one thread at a time (the caller of `generate`, a server's replica worker), and
its side lanes (threads, for the `streams` and `both` overlaps) work only inside its steps. Engines of one model may
step at once from different threads: they share its backend (whose calls are thread-safe), its estimates and its
shared lookup index (each guards itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from paradecode.graphs.errors import UserInputError
from paradecode.runtime.backends.base import Backend
from paradecode.runtime.batch import BatchStep
from paradecode.runtime.decoding import MAIN, DecodeContext, Executor, RowsContext, prefill
from paradecode.runtime.lanes import Lane
from paradecode.runtime.lookup import SharedSuffixIndex
from paradecode.runtime.notices import Notices
from paradecode.runtime.overlaps import ThreadedExecutor
from paradecode.runtime.proposers import DraftProposer, LookupProposer
from paradecode.runtime.request import Request
from paradecode.runtime.sampling import Sampler
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationResult, GenerationStats
from paradecode.runtime.stops import MAX_SEQ_LEN, Completion
from paradecode.runtime.tokenizer import TextTokenizer
from paradecode.runtime.tracing import NO_TRACING, Timeline, Tracing
from paradecode.runtime.verification import chosen
from paradecode.runtime.watched import WatchedFiles

# The engine's step kinds, counted for the server's metrics: one sequence decoding with ParaDecode, or every
# sequence in one batched call.
ALONE, TOGETHER = "alone", "together"
CLOSED, CANCELLED = "closed", "cancelled"  # a sequence's stop reasons when the model closes, or its caller stops it


@dataclass(frozen=True)
class Runtime:
    """What an engine decodes with: a loaded model's parts that every request shares and none changes. The shared
    estimates and lookup index change as requests decode, each behind an interface that guards itself."""

    backend: Backend
    tokenizer: TextTokenizer | None
    lanes: int  # per engine: the decoding thread and lanes - 1 side lanes (`streams` and `both`)
    estimates: Speculation  # adaptive speculation's costs and acceptance, learned from every request
    shared_lookup: SharedSuffixIndex  # earlier requests' outputs, for lookup across requests
    files: WatchedFiles  # what the model was loaded from: a request does not start once the folder changed
    closing: threading.Event  # set when the model closes: its engines end their sequences
    notices: Notices  # the model's once-only warnings

    @property
    def capacity(self) -> int:
        """The positions a sequence may take (a KV cache's slots, less a row form's spare ones)."""
        return self.backend.cache_capacity


@dataclass
class StreamedToken:
    token: int
    text: str  # the text this token completes ("" while a multi-byte character is incomplete)
    shown: str = ""  # the part of the shown text it releases (runtime/stops.py `Completion`: none of a stop string)


@dataclass(eq=False)
class Sequence:
    """One request while it decodes: everything of it, made from its resolved `Request` (`Sequence.of`), to its
    result. `sink` receives each `StreamedToken`, then the `GenerationResult`, or an exception if decoding failed;
    `cancelled()` is asked before each step. `tracing` is what a measuring tool asks of it (`runtime.tracing.Tracing`:
    spans of its calls in its `timeline`, an annotation around each call and phase, an exit policy)."""

    request: Request
    sink: Callable[[object], None]
    cancelled: Callable[[], bool]
    tracing: Tracing
    completion: Completion
    stats: GenerationStats
    timeline: Timeline  # the calls made for it alone
    sampler: Sampler | None  # None: greedy
    lookup: LookupProposer | None  # its prompt's and output's index (and the shared one, where asked); None: off
    draft: DraftProposer | None  # its draft head's guesses (where lookup has none); None: off
    position: int = 0  # the newest token's position: every position before it is in the row's cache
    decoder: Iterator[tuple[int, float, str | None]] | None = None  # its executor's tokens while it decodes alone
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def of(
        cls,
        request: Request,
        sink: Callable[[object], None],
        runtime: Runtime,
        *,
        cancelled: Callable[[], bool] = lambda: False,
        with_text: bool = True,
        tracing: Tracing = NO_TRACING,
    ) -> Sequence:
        sampling = request.sampling
        lookup = None
        if request.speculates and request.lookup is not None:
            lookup = LookupProposer(request.lookup, runtime.shared_lookup if request.lookup_shared else None)
        draft = None
        if request.speculates and request.draft_tokens:
            backend = runtime.backend
            reduces = bool(backend.manifest.feature_layers)
            draft = DraftProposer(request.draft_tokens, backend.spec.num_layers + 1, reduces=reduces)
        return cls(
            request,
            sink,
            cancelled,
            tracing,
            Completion(list(request.ids), request.stop, runtime.tokenizer, with_text),
            GenerationStats(
                mode=request.mode,
                overlap=request.overlap if request.speculates else None,
                prompt_tokens=len(request.ids),
                seed=None if sampling is None else sampling.seed,
            ),
            Timeline(record_spans=tracing.spans),
            None if sampling is None else Sampler(sampling, runtime.backend.exit_vocab()),
            lookup,
            draft,
        )

    @property
    def speculates(self) -> bool:
        return self.request.speculates

    @property
    def history(self) -> list[int]:
        """The prompt and every verified token (the newest at `position`)."""
        return [*self.request.ids, *self.completion.tokens]


class Engine:
    def __init__(self, runtime: Runtime, rows: int = 1):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise UserInputError(f"an engine needs a positive number of rows, got {rows!r}.")
        self.runtime = runtime
        self.backend = runtime.backend
        self.cache = self.backend.allocate_cache(rows)
        self.timeline = Timeline(record_spans=False)  # the batched calls of several rows
        self.sequences: list[Sequence] = []  # sequence i decodes in row i
        self.steps = {ALONE: 0, TOGETHER: 0}
        self._together: dict[int, BatchStep] = {}  # batch size -> its step (calls over views of the first rows)
        self._row_contexts: dict[int, DecodeContext] = {}  # row -> the calls of that row alone (views of it)
        self._side_lanes: list[Lane] | None = None  # made at the first `streams`/`both` request

    @property
    def rows(self) -> int:
        return self.cache.batch

    @property
    def size(self) -> int:
        return len(self.sequences)

    @property
    def full(self) -> bool:
        return self.size >= self.rows

    def join(self, sequence: Sequence) -> None:
        """Prefill `sequence` in the next free row and hand it its first token (it may end there)."""
        if self.full:
            raise UserInputError(f"the engine is full ({self.rows} rows): wait for a sequence to finish.")
        request = sequence.request
        row = self.size
        if not self.sequences:
            self.cache.shrink()  # the slots earlier sequences grew it to: every call would attend over them
        try:
            self.runtime.files.check()  # not started once the export's folder changed (runtime/watched.py)
            self.sequences.append(sequence)
            ctx = self._alone_context(row, sequence)
            sampler = sequence.sampler
            token, margin = prefill(
                ctx,
                list(request.ids),
                sampler.params if sampler else None,
                sampler.draws if sampler else None,
                sequence.draft,
            )
        except Exception as err:  # this request fails alone
            if sequence in self.sequences:
                self.sequences.remove(sequence)
            self._fail(sequence, err)
            return
        sequence.stats.prefill_seconds = time.perf_counter() - sequence.started
        sequence.position = len(request.ids)
        self._deliver(sequence, token, margin, request.stops.after(token, sequence.position))

    def step(self, waiting: bool = False) -> None:
        """The next verified tokens of every sequence in the engine (cancelled ones leave first; all of them once
        the model is closing). `waiting`: requests wait for a free row, so a sequence alone does not start
        speculating on its own."""
        closed = self.runtime.closing.is_set()
        if closed or any(s.cancelled() for s in self.sequences):
            for sequence in [s for s in self.sequences if closed or s.cancelled()]:
                self.leave(sequence, CLOSED if closed else CANCELLED)
        if not self.sequences:
            self.cache.shrink()
            return
        if self.size == 1 and not (waiting and not self.full) and self.sequences[0].speculates:
            self._step_alone(self.sequences[0])
        else:
            for sequence in self.sequences:
                self._hand_over(sequence)
            self._step_together()
        if not self.sequences:
            self.cache.shrink()  # an idle engine holds no slots a finished sequence grew its cache to

    def leave(self, sequence: Sequence, reason: str) -> None:
        """Take `sequence` out of the engine (its row filled by the last one) and hand it its result."""
        self._hand_over(sequence)
        row = self.sequences.index(sequence)
        last = self.sequences.pop()
        if last is not sequence:
            self.cache.move_row(self.size, row, last.position)
            self.sequences[row] = last
        stats, completion, timeline = sequence.stats, sequence.completion, sequence.timeline
        try:
            request = sequence.request
            if request.lookup_shared and request.lookup is not None and completion.tokens:
                self.runtime.shared_lookup.add(list(request.ids), completion.tokens)
            stats.stop_reason = reason
            stats.seconds = time.perf_counter() - sequence.started
            stats.new_tokens = len(completion.tokens)
            stats.lane_busy_seconds = {lane: busy for lane, busy in timeline.busy.items() if lane != "phases"}
            stats.calls = timeline.calls
            tokenizer = self.runtime.tokenizer
            text = tokenizer.completion(list(request.ids), completion.tokens) if tokenizer else None
        except Exception as err:  # it has left the engine: it must still get its end
            self._fail(sequence, err)
            return
        spans = timeline if timeline.record_spans else None
        shown = completion.shown.result if completion.text is not None else None
        result = GenerationResult(
            completion.tokens, text, stats, completion.margins, spans, shown, completion.stop_string
        )
        sequence.sink(result)

    def close(self, error: BaseException) -> None:
        """End every sequence with `error` (the engine cannot go on: a shutdown, or a failed batched call)."""
        for sequence in list(self.sequences):
            self._hand_over(sequence)
            self.sequences.remove(sequence)
            self._fail(sequence, error)
        self.cache.shrink()

    def free(self) -> None:
        """Stop the side lanes' threads (the engine is not used again)."""
        for lane in self._side_lanes or ():
            lane.close()
        self._side_lanes = []

    # --- the steps ----------------------------------------------------------------------------
    def _step_alone(self, sequence: Sequence) -> None:
        if sequence.decoder is None:
            ctx = self._alone_context(0, sequence)
            history = sequence.history
            sequence.decoder = self._executor(sequence, ctx, history[:-1]).run(resume=history[-1])
        self.steps[ALONE] += 1
        try:
            token, margin, stop = next(sequence.decoder)  # by the sequence's `stops`, as the batched steps
        except Exception as err:
            self._hand_over(sequence)
            self.sequences.remove(sequence)
            self._fail(sequence, err)
            return
        sequence.position += 1
        self._deliver(sequence, token, margin, stop)

    def _executor(self, sequence: Sequence, ctx: DecodeContext, history: list[int]) -> Executor:
        """ParaDecode's executor of `sequence` after `history` (everything verified before its newest token)."""
        request = sequence.request
        lanes = self.side_lanes() if request.overlap in ("streams", "both") else []
        return executor_of(
            self.runtime,
            request,
            ctx,
            history,
            sequence.stats,
            side_lanes=lanes,
            lookup=sequence.lookup,
            draft=sequence.draft,
            sampler=sequence.sampler,
            exit_policy=sequence.tracing.exit_policy,
        )

    def _step_together(self) -> None:
        n = self.size
        sequences = list(self.sequences)
        self.steps[TOGETHER] += 1
        try:
            form = self.backend.row_form
            if n == 1 or form is None or form.rows_alone:
                # a lone row's calls are the request's alone (the machine's row form pads them, as it does alone);
                # where several rows in one call compute otherwise than each alone, every row in calls of its own
                verdicts = [self._row_alone(row, s) for row, s in enumerate(sequences)]
            else:
                step = self._together.get(n)
                if step is None:
                    ctx = RowsContext(self.backend, self.cache.rows(0, n), self.timeline, observe=self._observe)
                    step = self._together[n] = BatchStep(ctx)
                verdicts = step.run(sequences, self.runtime.estimates)
        except Exception as err:
            self.close(err)
            return
        for sequence, tokens in zip(sequences, verdicts):  # every row's cache now holds its positions
            sequence.position += len(tokens)
        for sequence, tokens in zip(sequences, verdicts):  # the engine decodes these rows: it decides their stops
            position = sequence.position - len(tokens)
            for token, margin in tokens:
                position += 1
                stop = sequence.request.stops.after(token, position)
                self._deliver(sequence, token, margin, stop)
                if sequence not in self.sequences:
                    break

    def _row_alone(self, row: int, sequence: Sequence) -> list[tuple[int, float]]:
        """`sequence`'s newest token through every layer in calls of its row alone: a sequence alone in the engine,
        or any row where a call of several sequences computes a row otherwise than alone (`RowForm.rows_alone`), so
        its tokens stay those of the request decoded alone; such a batch shares the machine between requests but not
        the weights' reads. A lone row's calls feed the estimates and its own timeline, as its calls alone do."""
        ctx = self._row_contexts.get(row)
        if ctx is None:
            rows = self.cache.rows(row, row + 1)
            ctx = self._row_contexts[row] = DecodeContext(self.backend, rows, self.timeline, observe=self._observe)
        ctx.timeline = sequence.timeline if self.size == 1 else self.timeline
        position = sequence.position
        hidden = ctx.layers(
            MAIN, 1, ctx.num_layers, ctx.embed(MAIN, [sequence.completion.tokens[-1]], position), position
        )
        out = ctx.head(MAIN, "final", hidden, position, logits=sequence.sampler is not None)
        return [(chosen(out, 0, position, sequence.sampler), out.margin[0])]

    # --- a sequence's life ----------------------------------------------------------------------
    def side_lanes(self) -> list[Lane]:
        """The lanes beside the calling thread for `streams` and `both` (the runtime's `lanes` less one), made once."""
        if self._side_lanes is None:
            self._side_lanes = [Lane(f"side{i}", self.backend.new_stream()) for i in range(1, self.runtime.lanes)]
        return self._side_lanes

    def _observe(self, name: str, positions: int, seconds: float) -> None:
        self.runtime.estimates.observe(name, positions, seconds)

    def _alone_context(self, row: int, sequence: Sequence) -> DecodeContext:
        cache = self.cache.rows(row, row + 1)
        cache.reset()
        return DecodeContext(
            self.backend, cache, sequence.timeline, annotate=sequence.tracing.annotate, observe=self._observe
        )

    def _deliver(self, sequence: Sequence, token: int, margin: float, stop: str | None) -> None:
        """Hand `sequence` its next verified token and the decoder's stop decision after it."""
        piece, shown, stop = sequence.completion.push(token, margin, stop)
        if stop == MAX_SEQ_LEN:
            self.runtime.notices.say("full", len(sequence.completion.tokens), self.backend.manifest.max_seq_len)
        sequence.sink(StreamedToken(token, piece, shown))
        if stop:
            self.leave(sequence, stop)

    def _hand_over(self, sequence: Sequence) -> None:
        """Close a sequence's ParaDecode executor (it goes on in batched calls from its newest token, or leaves)."""
        if sequence.decoder is not None:
            sequence.decoder.close()
            sequence.decoder = None
            if sequence.lookup is not None:
                sequence.lookup.rewind(len(sequence.history))

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        sequence.sink(error)


def executor_of(
    runtime: Runtime,
    request: Request,
    ctx: DecodeContext,
    history: list[int],
    stats: GenerationStats,
    *,
    side_lanes: list[Lane] = (),
    lookup: LookupProposer | None = None,
    draft: DraftProposer | None = None,
    sampler: Sampler | None = None,
    exit_policy=None,
) -> Executor:
    """ParaDecode's executor of `request` over `ctx` after `history` (its prompt, or everything verified before the
    newest token when an engine hands a sequence back to ParaDecode), counting into `stats`: with `side_lanes` for
    the `streams` and `both` overlaps, the request's lookup and draft proposers and sampler, and `exit_policy` (its
    `Tracing`'s).
    Adaptive requests speculate by the runtime's estimates."""
    overlap = request.overlap
    lanes = list(side_lanes) if overlap in ("streams", "both") else []
    executor, more = (ThreadedExecutor, {"side_lanes": lanes}) if lanes else (Executor, {})
    return executor.of(
        ctx,
        history,
        request.stops,
        stats,
        thresholds=dict(request.thresholds),
        max_unverified=request.max_unverified,
        merge=overlap in ("batched", "both"),
        exit_policy=exit_policy,
        lookup=lookup,
        draft=draft,
        sampler=sampler,
        speculation=runtime.estimates if request.adaptive and exit_policy is None else None,
        **more,
    )


def generate_batched(
    runtime: Runtime, requests: list[Request], rows: int | None = None, engine: Engine | None = None
) -> list[GenerationResult]:
    """Decode `requests` together in one engine of `rows` rows (default: all of them, at most the export's
    max_batch), or in `engine` (an idle one of this runtime's, its rows kept: a server's), admitting the next as soon
    as one finishes; their results in order. Raises the first error."""
    if not requests:
        return []
    rows = rows or min(len(requests), runtime.backend.manifest.max_batch)
    results: list[object] = [None] * len(requests)

    def sink_of(i: int):
        def sink(event):
            if not isinstance(event, StreamedToken):
                results[i] = event

        return sink

    own = engine is None
    engine = Engine(runtime, rows) if own else engine
    pending = list(enumerate(requests))
    try:
        while pending or engine.size:
            while pending and not engine.full:
                i, request = pending.pop(0)
                engine.join(Sequence.of(request, sink_of(i), runtime, with_text=False))
            engine.step(waiting=bool(pending))
    finally:
        if own:
            engine.free()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
