"""The engine: steps the requests (`Sequence`s) that share one KV cache, over one loaded model.

Every decode goes through an `Engine`: `model.generate` and `model.stream` run one of one row, a server's replica
one of `--max-batch` rows (continuous batching). The model holds what requests share and never changes while they
decode (graphs, sessions, tokenizer, estimates); a `Sequence` holds everything of one request; an engine holds the
cache its sequences decode in, each in a row of its own ([rows, H_kv, S, D_h] per layer). Rows 0..n-1 are the
sequences in the engine: when one leaves, the last one moves into its row (one copy of the positions it holds), so
every call takes one view of the cache's first n rows, never a gather.

One `step` gives every sequence its next verified token:

- **Alone** (one `paradecode` sequence, nothing waiting for a row): it decodes with ParaDecode, one verified token
  of its ParaDecode `Executor` (runtime/decoding.py) per step, as it would in an engine of its own. When another request
  joins, its decoder is closed after its newest verified token and the row goes on in the batched calls from there
  (the cache holds every position before that token at every layer; what it held beyond is overwritten); when the
  others leave, a new decoder takes the row over from its newest token (`Executor.run(resume=...)`), without a
  prefill.
- **Together** (otherwise: plain decoding, or several sequences): every sequence's newest token goes through every
  layer in one call per segment of batch n, each row at its own position (the layer contract: positions [B, T] per
  row; a row's cache length is its position, and attention masks by position, so rows of every length share a
  call), then the final head gives each row its token: its top-1, or a draw from its distribution keyed by its
  position (sampling). This is plain decoding per row; a batched call costs little more than one row's (the weights
  are read once). Where the machine's row form says a call of several sequences computes a row otherwise than the
  sequence alone (`RowForm.rows_alone`, runtime/row_exactness.py: float-activation layers), each row's token goes
  through calls of its own row instead: the same tokens as the request alone, without the shared reads of the
  weights.

So speculation yields to load: with others to decode, a batched call's spare rows are the cheaper way to use the
machine (its cost grows far less than its rows), and ParaDecode's extra positions would take rows' place.

A joining request is prefilled alone in its row (batch 1, its whole prompt at once) before the next step. Each
sequence stops by the same rules however it decodes (its `Stops`, decided by the engine for its rows and by its
executor while alone, and its `Completion`'s stop strings); greedy outputs equal the request decoded alone up to
near ties of the final head's logits (a batched call's products may round otherwise than a batch-1 call's: the same
contract as ParaDecode's, docs/design.md §3). A sequence's `timeline` records the calls made for it alone (its
prefill, its steps alone); a batched call of several rows is recorded in the engine's.

Threading: an engine is stepped by one thread at a time (the caller of `generate`, a server's replica worker), and
its side lanes (threads, for the `streams` and `both` overlaps) work only inside its steps. Engines of one model may
step at once from different threads: they share its backend (whose calls are thread-safe) and its estimates.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paradecode.graphs.errors import UserInputError
from paradecode.runtime.completion import MAX_SEQ_LEN, Completion, Stops
from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.decoding import MAIN, DecodeContext, RowsContext, choose, prefill
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.lanes import NO_TRACING, Lane, Timeline, Tracing
from paradecode.runtime.sampling import Draws
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationResult, GenerationStats

if TYPE_CHECKING:
    from paradecode.runtime.model import ParaDecodeModel

# The engine's step kinds, counted for the server's metrics: one sequence decoding with ParaDecode, or every
# sequence's token in one batched call.
ALONE, TOGETHER = "alone", "together"
CLOSED, CANCELLED = "closed", "cancelled"  # a sequence's stop reasons when the model closes, or its caller stops it


@dataclass(frozen=True)
class Request:
    """A checked request (`ParaDecodeModel.request`): prompt token ids, settings, thresholds per exit layer."""

    ids: list[int]
    config: GenerationConfig
    thresholds: dict[int, float]


@dataclass
class StreamedToken:
    token: int
    text: str  # the text this token completes ("" while a multi-byte character is incomplete)


@dataclass(eq=False)
class Sequence:
    """One request while it decodes: everything of it, from its checked `Request` to its result. `sink` receives
    each `StreamedToken`, then the `GenerationResult`, or an exception if decoding failed; `cancelled()` is asked
    before each step.

    `tracing` is what a measuring tool asks of it (`runtime.lanes.Tracing`: spans of its calls in its `timeline`, an
    annotation around each call and phase, an exit policy); `timeline` records the calls made for it alone."""

    request: Request
    sink: Callable[[object], None]
    cancelled: Callable[[], bool] = lambda: False
    with_text: bool = True
    tracing: Tracing = NO_TRACING
    timeline: Timeline = field(init=False)
    completion: Completion = field(init=False)
    stops: Stops = field(init=False)
    stats: GenerationStats = field(init=False)
    sampling: object = field(init=False)
    draws: Draws | None = field(init=False)
    position: int = 0  # the newest token's position: every position before it is in the row's cache
    decoder: Iterator[tuple[int, float, str | None]] | None = None  # its executor's tokens while it decodes alone
    started: float = 0.0

    def __post_init__(self) -> None:
        self.timeline = Timeline(record_spans=self.tracing.spans)

    @property
    def speculates(self) -> bool:
        return self.request.config.mode == "paradecode"


class Engine:
    def __init__(self, model: ParaDecodeModel, rows: int = 1):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise UserInputError(f"an engine needs a positive number of rows, got {rows!r}.")
        self.model = model
        self.backend = model.backend
        self.cache: KVCache = self.backend.allocate_cache(rows)
        self.timeline = Timeline(record_spans=False)  # the batched calls of several rows
        # The estimates ParaDecode adapts by and its calls' costs feed: the model's (a warm-up sets its own).
        self.speculation: Speculation = model.speculation
        self.sequences: list[Sequence] = []  # sequence i decodes in row i
        self.steps = {ALONE: 0, TOGETHER: 0}
        self._together: dict[int, RowsContext] = {}  # batch size -> its context (views of the first rows)
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
        try:
            self.model.files.check()  # not started once the export's folder changed (runtime/watched.py)
            self._start(sequence)
            self.sequences.append(sequence)
            ctx = self._alone_context(row, sequence)
            token, margin = prefill(ctx, request.ids, sequence.sampling, sequence.draws)
        except Exception as err:  # this request fails alone
            if sequence in self.sequences:
                self.sequences.remove(sequence)
            self._fail(sequence, err)
            return
        sequence.stats.prefill_seconds = time.perf_counter() - sequence.started
        sequence.position = len(request.ids)
        self._deliver(sequence, token, margin, sequence.stops.after(token, sequence.position))

    def _start(self, sequence: Sequence) -> None:
        """A joining sequence's own state: its draws, statistics and output so far."""
        model, request = self.model, sequence.request
        config = request.config
        sequence.sampling = config.sampling(config.seed if config.seed is not None else secrets.randbits(63))
        sequence.draws = Draws(sequence.sampling.seed) if sequence.sampling is not None else None
        sequence.stats = GenerationStats(
            mode=config.mode,
            overlap=model.overlap_of(config) if config.mode == "paradecode" else None,
            prompt_tokens=len(request.ids),
            seed=None if sequence.sampling is None else sequence.sampling.seed,
        )
        sequence.completion = Completion(request.ids, config, model.tokenizer, sequence.with_text)
        sequence.stops = model.stops_of(request, self.cache.capacity)
        sequence.started = time.perf_counter()

    def step(self, waiting: bool = False) -> None:
        """One verified token for every sequence in the engine (cancelled ones leave first; all of them once the
        model is closed). `waiting`: requests wait for a free row, so a sequence alone does not start speculating."""
        closed = self.model.closed
        if closed or any(s.cancelled() for s in self.sequences):
            for sequence in [s for s in self.sequences if closed or s.cancelled()]:
                self.leave(sequence, CLOSED if closed else CANCELLED)
        if not self.sequences:
            return
        if self.size == 1 and not (waiting and not self.full) and self.sequences[0].speculates:
            self._step_alone(self.sequences[0])
        else:
            for sequence in self.sequences:
                self._hand_over(sequence)
            self._step_together()

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
            self.model.remember(sequence.request, completion.tokens)
            stats.stop_reason = reason
            stats.seconds = time.perf_counter() - sequence.started
            stats.new_tokens = len(completion.tokens)
            stats.lane_busy_seconds = {lane: busy for lane, busy in timeline.busy.items() if lane != "phases"}
            stats.calls = timeline.calls
            tokenizer, ids = self.model.tokenizer, sequence.request.ids
            text = tokenizer.completion(ids, completion.tokens) if tokenizer else None
        except Exception as err:  # it has left the engine: it must still get its end
            self._fail(sequence, err)
            return
        spans = timeline if timeline.record_spans else None
        sequence.sink(GenerationResult(completion.tokens, text, stats, completion.margins, spans))

    def close(self, error: BaseException) -> None:
        """End every sequence with `error` (the engine cannot go on: a shutdown, or a failed batched call)."""
        for sequence in list(self.sequences):
            self._hand_over(sequence)
            self.sequences.remove(sequence)
            self._fail(sequence, error)

    def free(self) -> None:
        """Stop the side lanes' threads (the engine is not used again)."""
        for lane in self._side_lanes or ():
            lane.close()
        self._side_lanes = []

    # --- the steps ----------------------------------------------------------------------------
    def _step_alone(self, sequence: Sequence) -> None:
        if sequence.decoder is None:
            completion = sequence.completion
            ctx = self._alone_context(0, sequence)
            history = sequence.request.ids + completion.tokens[:-1]
            decoder = self.model.paradecoder(
                ctx,
                history,
                sequence.request,
                None,  # the request's overlap
                sequence.sampling,
                stops=sequence.stops,
                stats=sequence.stats,
                side_lanes=self.side_lanes(),
                speculation=self.speculation,
                exit_policy=sequence.tracing.exit_policy,
            )
            sequence.decoder = decoder.run(resume=completion.tokens[-1])
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

    def _step_together(self) -> None:
        n = self.size
        sequences = list(self.sequences)
        sampled = any(s.sampling is not None for s in sequences)
        self.steps[TOGETHER] += 1
        try:
            form = self.backend.row_form
            if n == 1 or form is None or form.rows_alone:
                # a lone row's calls are the request's alone (the machine's row form pads them, as it does alone); where
                # several rows in one call compute otherwise than each alone, every row in calls of its own
                outs = [self._row_alone(row, s, sampled) for row, s in enumerate(sequences)]
            else:
                ctx = self._together.get(n)
                if ctx is None:
                    ctx = self._together[n] = RowsContext(self.backend, self.cache.rows(0, n), self.timeline)
                ctx.begin([s.position for s in sequences])
                hidden = ctx.layers(
                    MAIN, 1, ctx.num_layers, ctx.embed_rows([[s.completion.tokens[-1]] for s in sequences]), 0
                )
                out = ctx.head(MAIN, "final", hidden, 0, logits=sampled)
                outs = [(out, row) for row in range(n)]
        except Exception as err:
            self.close(err)
            return
        picks = [
            (choose(out, i, s.position, s.sampling, s.draws), out.margin[i]) for (out, i), s in zip(outs, sequences)
        ]
        for sequence in sequences:  # every row's cache now holds its position: all move on before any leaves
            sequence.position += 1
        for sequence, (token, margin) in zip(sequences, picks):  # the engine decodes these rows: it decides their stops
            self._deliver(sequence, token, margin, sequence.stops.after(token, sequence.position))

    def _row_alone(self, row: int, sequence: Sequence, sampled: bool) -> tuple:
        """`sequence`'s newest token through every layer in calls of its row alone: a sequence alone in the engine, or
        any row where a call of several sequences computes a row otherwise than alone (`RowForm.rows_alone`), so its
        tokens stay those of the request decoded alone; such a batch shares the machine between requests but not the
        weights' reads. A lone row's calls feed the estimates and its own timeline, as its calls alone do."""
        ctx = self._row_contexts.get(row)
        if ctx is None:
            rows = self.cache.rows(row, row + 1)
            ctx = self._row_contexts[row] = DecodeContext(self.backend, rows, self.timeline, observe=self._observe)
        ctx.timeline = sequence.timeline if self.size == 1 else self.timeline
        position = sequence.position
        hidden = ctx.layers(
            MAIN, 1, ctx.num_layers, ctx.embed(MAIN, [sequence.completion.tokens[-1]], position), position
        )
        return ctx.head(MAIN, "final", hidden, position, logits=sampled), 0

    # --- a sequence's life ----------------------------------------------------------------------
    def side_lanes(self) -> list[Lane]:
        """The lanes beside the calling thread for `streams` and `both` (the model's `lanes` less one), made once."""
        if self._side_lanes is None:
            self._side_lanes = [Lane(f"side{i}", self.backend.new_stream()) for i in range(1, self.model.lanes)]
        return self._side_lanes

    def _observe(self, name: str, tokens: int, seconds: float) -> None:
        self.speculation.times.observe(name, tokens, seconds)

    def _alone_context(self, row: int, sequence: Sequence) -> DecodeContext:
        cache = self.cache.rows(row, row + 1)
        cache.reset()
        return DecodeContext(
            self.backend, cache, sequence.timeline, annotate=sequence.tracing.annotate, observe=self._observe
        )

    def _deliver(self, sequence: Sequence, token: int, margin: float, stop: str | None) -> None:
        """Hand `sequence` its next verified token and the decoder's stop decision after it."""
        piece, stop = sequence.completion.push(token, margin, stop)
        if stop == MAX_SEQ_LEN:
            self.model.warn_full(len(sequence.completion.tokens))
        sequence.sink(StreamedToken(token, piece))
        if stop:
            self.leave(sequence, stop)

    def _hand_over(self, sequence: Sequence) -> None:
        """Close a sequence's ParaDecode executor (it goes on in batched calls from its newest token, or leaves)."""
        if sequence.decoder is not None:
            sequence.decoder.close()
            sequence.decoder = None

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        sequence.sink(error)


def generate_batched(
    model: ParaDecodeModel, requests: list[Request], rows: int | None = None, engine: Engine | None = None
) -> list[GenerationResult]:
    """Decode `requests` together in one engine of `rows` rows (default: all of them, at most the export's
    max_batch), or in `engine` (an idle one of this model's, its rows kept: a server's), admitting the next as soon
    as one finishes; their results in order. Raises the first error."""
    if not requests:
        return []
    rows = rows or min(len(requests), model.manifest.max_batch)
    results: list[object] = [None] * len(requests)

    def sink_of(i: int):
        def sink(event):
            if not isinstance(event, StreamedToken):
                results[i] = event

        return sink

    own = engine is None
    engine = Engine(model, rows) if own else engine
    pending = list(enumerate(requests))
    try:
        while pending or engine.size:
            while pending and not engine.full:
                i, request = pending.pop(0)
                engine.join(Sequence(request, sink_of(i), with_text=False))
            engine.step(waiting=bool(pending))
    finally:
        if own:
            engine.free()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
