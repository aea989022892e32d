"""Continuous batching: the requests of one process decoded together, one batched call per subgraph, over one copy
of the model.

A `Batch` holds a KV cache of `rows` rows ([rows, H_kv, S, D_h] per layer) beside a loaded model, and decodes
the `Sequence`s that join it, each in a row of its own. Rows 0..n-1 are the sequences in the batch: when one
leaves, the last one moves into its row (one copy of the positions it holds), so every call takes one view of
the cache's first n rows, never a gather.

One `step` gives every sequence in the batch its next verified token:

- **Together** (two or more sequences): every sequence's newest token goes through every layer in one call per
  segment of batch n, each row at its own position (the layer contract: positions [B, T] per row; a row's cache
  length is its position, and attention masks by position, so rows of every length share a call), then the final
  head gives each row its token: its top-1, or a draw from its distribution keyed by its position (sampling).
  This is plain decoding per row; a batched call costs little more than one row's (the weights are read once).
  On an export with int8 activations in its layers (`Manifest.padded_attention`) a call of several rows computes
  otherwise than the same rows alone (onnxruntime's attention kernel takes its one-token path for them, and int8
  rounding amplifies the difference), so there each row's token goes through calls of its own row: the same tokens
  as the request alone, without the shared reads of the weights.
- **Alone** (one sequence, nothing waiting): a `paradecode` request decodes with ParaDecode, one verified token
  of its `ParaDecoder` per step, as it would alone. When another request joins, its decoder is closed after its
  newest verified token and the row goes on in the batched calls from there (the cache holds every position
  before that token at every layer; what it held beyond is overwritten); when the others leave, a new decoder
  takes the row over from its newest token (`ParaDecoder.run(resume=...)`), without a prefill.

So speculation yields to load: with others to decode, a batched call's spare rows are the cheaper way to use the
machine (its cost grows far less than its rows), and ParaDecode's extra positions would take rows' place.

A joining request is prefilled alone in its row (batch 1, its whole prompt at once) before the next step. Each
sequence's output stops by the same rules as a request decoded alone (its `Stops`, decided by the batch for its
rows and by its ParaDecoder while alone, and its `Completion`'s stop strings); greedy outputs equal the
request decoded alone up to near ties of the final head's logits (a batched call's products may round otherwise
than a batch-1 call's: the same contract as ParaDecode's, docs/design.md §3).

Threading: a `Batch` is used by one thread at a time (a server's batch worker). It shares the model's backend,
weights and speculation estimates but not its cache: the model must not decode other requests meanwhile.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.tensors import HIDDEN, INPUT_IDS, POSITIONS
from paradecode.runtime.completion import Completion, Stops
from paradecode.runtime.decoding import MAIN, DecodeContext, choose, prefill
from paradecode.runtime.kvcache import KVCache
from paradecode.runtime.lanes import Timeline
from paradecode.runtime.model import ParaDecodeModel, Request, StreamedToken
from paradecode.runtime.row_exactness import AS_IS
from paradecode.runtime.sampling import Draws
from paradecode.runtime.stats import GenerationResult, GenerationStats

# The batch's own step kinds, counted for the server's metrics: one sequence decoding with ParaDecode, or every
# sequence's token in one batched call.
ALONE, TOGETHER = "alone", "together"


class RowsContext(DecodeContext):
    """The calls over rows 0..n-1 of a batch's cache, one token per row, each at its own position."""

    row_positions: torch.Tensor  # [n, 1], set before each step

    def at(self, start: int, tokens: int) -> torch.Tensor:
        return self.row_positions

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # one position per row, each at its own: nothing to pad (runtime/row_exactness.py)

    def embed_rows(self, ids: list[int]) -> torch.Tensor:
        feeds = {INPUT_IDS: torch.tensor(ids, dtype=torch.int64)[:, None]}
        if self.learned_positions:
            feeds[POSITIONS] = self.row_positions
        first, last = int(self.row_positions.min()), int(self.row_positions.max())
        return self._call(MAIN, "embed", "embed", first, last + 1, feeds)[HIDDEN]


@dataclass(eq=False)
class Sequence:
    """One request in a batch: its output so far and where it is. `sink` receives each `StreamedToken`, then the
    `GenerationResult`, or an exception if decoding failed; `cancelled()` is asked before each step."""

    request: Request
    sink: Callable[[object], None]
    cancelled: Callable[[], bool] = lambda: False
    with_text: bool = True
    completion: Completion = field(init=False)
    stops: Stops = field(init=False)
    stats: GenerationStats = field(init=False)
    sampling: object = field(init=False)
    draws: Draws | None = field(init=False)
    position: int = 0  # the newest token's position: every position before it is in the row's cache
    decoder: Iterator[tuple[int, float, str | None]] | None = None  # its ParaDecoder while it decodes alone
    started: float = 0.0

    @property
    def speculates(self) -> bool:
        return self.request.config.mode == "paradecode"


class Batch:
    def __init__(self, model: ParaDecodeModel, rows: int):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise UserInputError(f"a batch needs a positive number of rows, got {rows!r}.")
        self.model = model
        self.backend = model.backend
        self.cache: KVCache = self.backend.allocate_cache(rows)
        self.timeline = Timeline(record_spans=False)
        self.sequences: list[Sequence] = []  # sequence i decodes in row i
        # Per row, the slots known to hold finite numbers (written or zeroed). A batched call's attention may read a
        # row past its own position, up to the batch's highest (masked): on a CPU the cache starts uninitialised
        # (untouched pages cost nothing), and a masked NaN there would still reach the output (0 x NaN), so those
        # slots are zeroed once before the first call that reads them.
        self.finite = [0] * rows
        self.steps = {ALONE: 0, TOGETHER: 0}
        self._together: dict[int, RowsContext] = {}  # batch size -> its context (views of the first rows)
        # onnxruntime computes a call of several rows otherwise than each row alone here: see `_row_alone`
        self.rows_alone = model.manifest.padded_attention and self.backend.name == "onnxruntime"
        self._row_contexts: dict[int, DecodeContext] = {}  # row -> the calls of that row alone (views of it)

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
            raise UserInputError(f"the batch is full ({self.rows} rows): wait for a sequence to finish.")
        request = sequence.request
        row = self.size
        try:
            self.model.files.check()  # not started once the export's folder changed (runtime/watched.py)
            self._start(sequence)
            self.sequences.append(sequence)
            ctx = self._alone_context(row)
            token, margin = prefill(ctx, request.ids, sequence.sampling, sequence.draws)
        except Exception as err:  # this request fails alone
            if sequence in self.sequences:
                self.sequences.remove(sequence)
            self._fail(sequence, err)
            return
        self.finite[row] = max(self.finite[row], len(request.ids))  # the prefill wrote the prompt's slots
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
        """One verified token for every sequence in the batch (cancelled ones leave first). `waiting`: requests
        wait to join, so a sequence alone does not start speculating."""
        for sequence in [s for s in self.sequences if s.cancelled()]:
            self._leave(sequence, "cancelled")
        if not self.sequences:
            return
        if self.size == 1 and not waiting and self.sequences[0].speculates:
            self._step_alone(self.sequences[0])
        else:
            for sequence in self.sequences:
                self._hand_over(sequence)
            self._step_together()

    def close(self, error: BaseException) -> None:
        """End every sequence with `error` (the batch cannot go on: a shutdown, or a failed batched call)."""
        for sequence in list(self.sequences):
            self._hand_over(sequence)
            self.sequences.remove(sequence)
            self._fail(sequence, error)

    # --- the steps ----------------------------------------------------------------------------
    def _step_alone(self, sequence: Sequence) -> None:
        if sequence.decoder is None:
            completion = sequence.completion
            ctx = self._alone_context(0)
            history = sequence.request.ids + completion.tokens[:-1]
            overlap = self.model.overlap_of(sequence.request.config)
            decoder = self.model.paradecoder(
                ctx, history, sequence.request, overlap, sequence.sampling, stops=sequence.stops, stats=sequence.stats
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
        ctx = self._together.get(n)
        if ctx is None:
            ctx = self._together[n] = RowsContext(self.backend, self.cache.rows(0, n), self.timeline)
        sequences = list(self.sequences)
        span = max(s.position for s in sequences) + 1
        for row, sequence in enumerate(sequences):
            start = max(self.finite[row], sequence.position)  # never below the row's own entries
            if start < span:
                self.cache.zero(row, start, span)
            self.finite[row] = max(start, span)
        ctx.row_positions = torch.tensor([[s.position] for s in sequences], dtype=torch.int64)
        sampled = any(s.sampling is not None for s in sequences)
        self.steps[TOGETHER] += 1
        try:
            if self.rows_alone or (n == 1 and self.backend.row_form not in (None, AS_IS)):
                # a lone row runs as the machine's form pads it, as the same request alone does
                outs = [self._row_alone(row, s, sampled) for row, s in enumerate(sequences)]
            else:
                hidden = ctx.layers(
                    MAIN, 1, ctx.num_layers, ctx.embed_rows([s.completion.tokens[-1] for s in sequences]), 0
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
        for sequence, (token, margin) in zip(sequences, picks):  # the batch decodes these rows: it decides their stops
            self._deliver(sequence, token, margin, sequence.stops.after(token, sequence.position))

    def _row_alone(self, row: int, sequence: Sequence, sampled: bool) -> tuple:
        """`sequence`'s newest token through every layer in calls of its row alone: for an export whose several-row
        calls compute otherwise than one row's (`Manifest.padded_attention`), so its tokens stay those of the request
        decoded alone; such a batch shares the machine between requests but not the weights' reads."""
        ctx = self._row_contexts.get(row)
        if ctx is None:
            ctx = self._row_contexts[row] = DecodeContext(self.backend, self.cache.rows(row, row + 1), self.timeline)
        position = sequence.position
        hidden = ctx.layers(
            MAIN, 1, ctx.num_layers, ctx.embed(MAIN, [sequence.completion.tokens[-1]], position), position
        )
        return ctx.head(MAIN, "final", hidden, position, logits=sampled), 0

    # --- a sequence's life ----------------------------------------------------------------------
    def _alone_context(self, row: int) -> DecodeContext:
        cache = self.cache.rows(row, row + 1)
        cache.reset()
        return DecodeContext(self.backend, cache, self.timeline, observe=self.model.speculation.times.observe)

    def _deliver(self, sequence: Sequence, token: int, margin: float, stop: str | None) -> None:
        """Hand `sequence` its next verified token and the decoder's stop decision after it."""
        piece, stop = sequence.completion.push(token, margin, stop)
        sequence.sink(StreamedToken(token, piece))
        if stop:
            self._leave(sequence, stop)

    def _hand_over(self, sequence: Sequence) -> None:
        """Close a sequence's ParaDecoder (it goes on in batched calls from its newest token, or leaves)."""
        if sequence.decoder is not None:
            sequence.decoder.close()
            sequence.decoder = None

    def _leave(self, sequence: Sequence, reason: str) -> None:
        """Take `sequence` out of the batch (its row filled by the last one) and hand it its result."""
        self._hand_over(sequence)
        row = self.sequences.index(sequence)
        last = self.sequences.pop()
        if last is not sequence:
            self.cache.move_row(self.size, row, last.position)
            self.finite[row] = max(self.finite[row], last.position)
            self.sequences[row] = last
        stats, completion = sequence.stats, sequence.completion
        try:
            self.model.remember(sequence.request, completion.tokens)
            stats.stop_reason = reason
            stats.seconds = time.perf_counter() - sequence.started
            stats.new_tokens = len(completion.tokens)
            tokenizer, ids = self.model.tokenizer, sequence.request.ids
            text = tokenizer.completion(ids, completion.tokens) if tokenizer else None
        except Exception as err:  # it has left the batch: it must still get its end
            self._fail(sequence, err)
            return
        sequence.sink(GenerationResult(completion.tokens, text, stats, completion.margins))

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        sequence.sink(error)


def generate_batched(
    model: ParaDecodeModel, requests: list[Request], rows: int | None = None, batch: Batch | None = None
) -> list[GenerationResult]:
    """Decode `requests` together in one batch of `rows` rows (default: all of them, at most the export's
    max_batch), or in `batch` (an idle one of this model's, its rows kept: a server's), admitting the next as soon
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

    batch = batch if batch is not None else Batch(model, rows)
    pending = list(enumerate(requests))
    while pending or batch.size:
        while pending and not batch.full:
            i, request = pending.pop(0)
            batch.join(Sequence(request, sink_of(i), with_text=False))
        batch.step(waiting=bool(pending))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
