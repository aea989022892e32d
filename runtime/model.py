"""`ParaDecodeModel`: load an export once, then generate with `ar` or `paradecode`, whole or streamed.

Threading model
---------------
A model may be shared by many threads; its calls are *serialised* (one at a time, in arrival order)
because they share the KV cache and the lanes. For parallel requests over one copy of the weights, batch them
(runtime/batching.py), or load one model per worker.

- `_lock` is held by the call that is decoding, from its first token request (`next()` on its
  stream; `generate` does that at once) until the stream is exhausted or closed.
- `_owner` is the thread holding `_lock`: set and reset only by that thread, while it holds the lock.
  A second call from the same thread while its own stream is open is refused (it would wait for
  itself), both when the stream is created and when it first asks for a token.
- `_state` guards `_closed` and `_active` (the stream holding `_lock`).
- `close()` marks the model closed, ends the stream holding it (at once if it is idle, after its
  current token if another thread is computing it), waits for `_lock`, and frees the lanes and the
  backend. Every later call raises `ModelClosedError`.

A failed request (bad input, an error while decoding, a stopped stream) leaves the model usable. The model
computes with the export as it read it at load, whatever happens to its folder later; once the folder no longer
holds those files (compared by content), every call refuses with `ExportChangedError` before it starts, and
a stream already decoding finishes (runtime/watched.py).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from paradecode.graphs.errors import ModelClosedError, ParadecodeError, UserInputError
from paradecode.graphs.manifest import TOKENIZER_DIR
from paradecode.runtime import policy
from paradecode.runtime.backends import backend_class
from paradecode.runtime.chat import ChatTemplate
from paradecode.runtime.completion import MAX_SEQ_LEN, Completion, Stops
from paradecode.runtime.config import GenerationConfig, check_token_ids
from paradecode.runtime.decoding import DecodeContext, decode_ar
from paradecode.runtime.lanes import Lane, Timeline
from paradecode.runtime.loader import ExportFolder, open_export
from paradecode.runtime.lookup import SharedSuffixIndex
from paradecode.runtime.scheduler import STALL_SECONDS, ParaDecoder
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationResult, GenerationStats
from paradecode.runtime.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


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


class GenerationStream:
    """Iterate to receive tokens as they are verified; `result` holds everything once iteration ends.

    A stream holds its model from its first token until it is exhausted or closed: stop early with
    `close()` (or use it as a context manager) so the model can serve the next call.
    """

    def __init__(self) -> None:
        self._tokens: Iterator[StreamedToken] = iter(())
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamedToken]:
        return self._tokens

    def __next__(self) -> StreamedToken:
        return next(self._tokens)

    def close(self) -> None:
        self._tokens.close()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ParaDecodeModel:
    def __init__(
        self,
        path: str | Path | ExportFolder,
        *,
        backend: str = "onnxruntime",
        device: str = "cpu",
        lanes: int = 2,
        threads: int | None = None,
        cuda_graphs: bool = True,
        torch_compile: bool = False,
        verify: bool = True,
    ):
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise UserInputError(f"lanes must be a positive integer (the calling thread counts as one), got {lanes!r}.")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise UserInputError(f"threads must be a positive integer (threads per onnxruntime call), got {threads!r}.")
        # An opened export is shared (a server's replicas): `verify` is how it was opened.
        self.export = path if isinstance(path, ExportFolder) else open_export(path, verify=verify)
        # Text first: a broken tokenizer or chat template is refused before the sessions load.
        self.tokenizer = TextTokenizer(self.export.tokenizer_path) if self.export.tokenizer_path else None
        self.chat_template = ChatTemplate.from_export(self.export)
        if torch_compile and backend != "torch":
            raise UserInputError(
                f"torch_compile compiles the torch backend's modules; the {backend!r} backend runs the export's own "
                "graphs. Use backend='torch' (--backend torch), or leave torch_compile off."
            )
        options = {}
        if backend == "onnxruntime":
            # None: every core per call, but one for the layer graphs' decoding calls in int8-activation exports
            # (onnxruntime_backend's THREADS, measured); lane 0 alone computes in ar and in `batched` (a CPU's default).
            options["threads"] = threads
        elif backend == "torch":
            options["cuda_graphs"] = cuda_graphs
            options["torch_compile"] = torch_compile
        self.backend = backend_class(backend)(self.export, device=device, **options)
        self.cache = self.backend.allocate_cache()
        self.side_lanes = [Lane(f"side{i}", self.backend.new_stream()) for i in range(1, lanes)]
        # What decoding has measured of this model's call costs and acceptance: carried over between requests.
        self.speculation = Speculation(self.backend.spec.num_layers)
        # What its requests' outputs continued with, for lookup proposals across requests (runtime/lookup.py).
        self.shared_index = SharedSuffixIndex()
        self.files = self.export.files  # what the model was loaded from, compared with its folder (watched.py)
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._state = threading.Lock()
        self._closed = False
        self._active: GenerationStream | None = None
        self._warned_full = False
        self._warned_untrained = False
        self._warned_idle = False
        self._warned_inexact = False

    @property
    def manifest(self):
        return self.export.manifest

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the call holding the model (if any), then free the lanes and the backend. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + STALL_SECONDS
        while not self._lock.acquire(timeout=0.05):
            with self._state:
                active = self._active
            if active is not None:
                # An idle stream (between two tokens) ends now, from this thread. One that another thread is
                # computing raises ValueError ("generator already executing"): it ends at its next token
                # boundary (it sees `_closed`), or this loop closes it once it is idle.
                with contextlib.suppress(ValueError):
                    active.close()
            if time.monotonic() > deadline:
                raise ParadecodeError(
                    f"close() waited {STALL_SECONDS:g} s for the running call to end; the model was not freed."
                )
        try:
            for lane in self.side_lanes:
                lane.close()
            self.side_lanes = []
            self.backend.close()
        finally:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public API ---------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        config: GenerationConfig | None = None,
        trace: bool = False,
        annotate=None,
        exit_policy=None,
        **settings,
    ) -> GenerationResult:
        """Decode greedily after `prompt` (text), `prompt_ids` or `messages` (a chat, rendered with the
        export's chat template); settings override `config`'s fields.

        `trace=True` keeps every subgraph call's span in `result.timeline`; `annotate(name)` (a context
        manager factory, such as an NVTX range) wraps every call and scheduler phase while profiling.
        `exit_policy` replaces the threshold test, for controlled measurements only (see ParaDecoder).
        """
        stream = self._stream(prompt, prompt_ids, config, trace, settings, False, annotate, exit_policy, messages)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        config: GenerationConfig | None = None,
        trace: bool = False,
        **settings,
    ) -> GenerationStream:
        """Like `generate`, but yields each token as soon as it is verified."""
        return self._stream(prompt, prompt_ids, config, trace, settings, True, messages=messages)

    def _stream(
        self,
        prompt,
        prompt_ids,
        config,
        trace: bool,
        settings: dict,
        text: bool,
        annotate=None,
        exit_policy=None,
        messages=None,
    ) -> GenerationStream:
        """Check the request completely (a bad one raises here, before it holds the model), then make its stream."""
        self._check_open()
        self.files.check()
        request = self.request(prompt, prompt_ids, messages, config, **settings)
        self._refuse_reentry()
        stream = GenerationStream()
        stream._tokens = self._run(request, Timeline(record_spans=trace), stream, text, annotate, exit_policy)
        return stream

    def warm_up(self, config: GenerationConfig | None = None, batch=None) -> None:
        """Decode a few tokens in the kinds of call decoding makes (a prefill; one position; several, as exits
        and lookup proposals do; with `batch`, a `runtime.batching.Batch` of this model's, several requests in one
        call), with `config`'s settings (a server's: sampling, overlap, K) and with every token exiting. With
        `torch_compile`, the modules compile now rather than in the first requests (`paradecode-serve --compile`
        does this before it listens); shapes it did not meet still compile at their first use. What the warm-up
        measures does not reach the adaptive speculation, and its outputs not the shared lookup."""
        from paradecode.runtime.batching import generate_batched  # it imports this module

        config = config or GenerationConfig()
        length = max(1, min(8, self.cache.capacity // 2))
        prompt = [t % self.backend.spec.vocab_size for t in (1, 2, 3) * 3][:length]  # repeated: lookup proposes
        settings = dict(config=config, max_new_tokens=length, ignore_eos=True, lookup_shared=False)
        saved = self.speculation, self._warned_full, self._warned_untrained, self._warned_idle
        self.speculation = Speculation(self.backend.spec.num_layers)
        self._warned_full = self._warned_untrained = self._warned_idle = True  # said by requests, not the warm-up
        try:
            self.generate(prompt_ids=prompt, **settings, mode="ar")
            self.generate(prompt_ids=prompt, **settings)
            self.generate(prompt_ids=prompt, **settings, thresholds=0.0)  # every token exits
            if batch is not None:
                requests = [
                    self.request(prompt_ids=prompt[: max(1, length - i)], **settings) for i in range(batch.rows)
                ]
                generate_batched(self, requests, batch=batch)
        finally:
            self.speculation, self._warned_full, self._warned_untrained, self._warned_idle = saved

    def request(
        self,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        config: GenerationConfig | None = None,
        **settings,
    ) -> Request:
        """A request checked completely against this export (a bad one raises UserInputError here): its prompt's
        token ids, its settings (`config` with `settings` applied) and its thresholds per exit layer."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise UserInputError(f"config must be a GenerationConfig, got {type(config).__name__}.")
        config = replace(config or GenerationConfig(), **settings) if settings else (config or GenerationConfig())
        ids = self.prompt_ids(prompt, prompt_ids, messages)
        if config.stop and self.tokenizer is None:
            raise UserInputError(
                f"stop strings {list(config.stop)!r} need the export's tokenizer to read the output as text, and "
                f"{self.export.path} has none: leave out the stop strings (stop on max_new_tokens or an "
                "end-of-sequence token), or export the model with its tokenizer."
            )
        if config.temperature != 0 and not self.manifest.with_logits:
            raise UserInputError(
                f"sampling (temperature {config.temperature}) needs the heads' logits, and {self.export.path} was "
                "exported with --no-logits: re-export without it, or decode greedily (temperature 0)."
            )
        if config.mode == "paradecode" and self.backend.row_form is None:
            self._warn_inexact()  # ParaDecode could not keep plain decoding's output here: decode as it does
            config = replace(config, mode="ar")
        thresholds = {}
        if config.mode == "paradecode":
            device, overlap = self.backend.device.type, self.overlap_of(config)
            thresholds = config.resolve_thresholds(self.manifest.thresholds, device, overlap)
            if config.skips_exits(device, overlap) and not config.lookup_tokens:
                self._warn_idle(device)
        if config.mode == "paradecode" and config.thresholds is None and self.manifest.head_kind == "identity":
            self._warn_untrained()
        return Request(ids, config, thresholds)

    def paradecoder(
        self,
        ctx: DecodeContext,
        ids: list[int],
        request: Request,
        overlap: str,
        sampling,
        *,
        stops: Stops,
        stats: GenerationStats,
        exit_policy=None,
    ) -> ParaDecoder:
        """ParaDecode of `request` after `ids` (its prompt, or everything verified so far when a batch hands a
        request back to ParaDecode) over `ctx` until `stops` (the request's), with this model's lanes and
        speculation estimates, counting into `stats`."""
        config = request.config
        adaptive = config.adapts(self.backend.device.type, overlap) and exit_policy is None
        return ParaDecoder(
            ctx,
            ids,
            stops,
            stats,
            thresholds=request.thresholds,
            max_unverified=config.max_unverified,
            overlap=overlap,
            side_lanes=self.side_lanes,
            exit_policy=exit_policy,
            lookup=config.lookup_config(),
            shared=self.shared_index if config.lookup_shared else None,
            sampling=sampling,
            speculation=self.speculation if adaptive else None,
        )

    def remember(self, request: Request, tokens: list[int]) -> None:
        """Add a finished request's verified tokens to the outputs later requests' lookup proposes from."""
        config = request.config
        if config.lookup_shared and config.lookup_tokens and tokens:
            self.shared_index.add(request.ids, tokens)

    def eos_of(self, config: GenerationConfig) -> tuple[int, ...]:
        """The tokens that end a request's output (none when it ignores end-of-sequence tokens)."""
        return () if config.ignore_eos else tuple(self.export.eos_token_ids)

    def stops_of(self, request: Request, capacity: int) -> Stops:
        """Where decoding `request` stops by itself, in a KV cache of `capacity` positions."""
        config = request.config
        return Stops(len(request.ids), config.max_new_tokens, frozenset(self.eos_of(config)), capacity)

    def overlap_of(self, config: GenerationConfig) -> str:
        """The request's overlap with `auto` resolved for this model's device."""
        return config.overlap if config.overlap != "auto" else policy.auto_overlap(self.backend.device.type)

    # --- internals --------------------------------------------------------------------------
    def _warn_untrained(self) -> None:
        if not self._warned_untrained:  # once per model
            self._warned_untrained = True
            logger.warning(
                "%s has no trained exit heads, so ParaDecode does not exit early by default and decodes like ar "
                "(the model's own head at an intermediate layer rarely agrees with the last layer). Train heads "
                "with `paradecode-train-heads MODEL -o heads.safetensors` and export with --heads, or pass "
                "thresholds to exit with the model's own head anyway.",
                self.export.path,
            )

    def _warn_inexact(self) -> None:
        if not self._warned_inexact:  # once per model
            self._warned_inexact = True
            logger.warning(
                "ParaDecode requests on %s decode as plain decoding (mode 'ar') on this machine: its kernels give a "
                "position other bits in a call of several positions than in a call of its own, so verifying several "
                "at once would change the output (runtime/row_exactness.py). Re-export with other --activations or "
                "--weights to try another form.",
                self.export.path.name,
            )

    def _warn_idle(self, device: str) -> None:
        if not self._warned_idle:  # once per model
            self._warned_idle = True
            logger.warning(
                "ParaDecode here has nothing to speculate: with the export's thresholds it calls no exit heads %s "
                "(measured not to pay: `GenerationConfig.skips_exits`), and lookup is off. Decode with mode 'ar' "
                "(it is faster), turn lookup on, or pass thresholds or adaptive=False (--adaptive off) to use the "
                "exit heads anyway.",
                "on CUDA" if device == "cuda" else "when sampling on a CPU",
            )

    def _warn_full(self, new_tokens: int) -> None:
        if not self._warned_full:  # once per model; every result says so in stats.stop_reason
            self._warned_full = True
            logger.warning(
                "stopped after %d new tokens: the KV cache is full (max_seq_len %d). Re-export with a larger "
                "--max-seq-len for longer outputs.",
                new_tokens,
                self.manifest.max_seq_len,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError("this model is closed: load the export again to decode with it.")

    def _refuse_reentry(self) -> None:
        if self._owner == threading.get_ident():
            raise UserInputError(
                "this thread still has an open stream on this model: exhaust it or call its "
                "close() (or use `with model.stream(...) as stream:`) before the next call."
            )

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """`messages` as the model reads them: the export's chat template, ending with the assistant's header."""
        if self.chat_template is None:
            raise UserInputError(
                f"this export has no chat template: {self.export.path / TOKENIZER_DIR} has no chat_template.jinja "
                "and no chat_template in tokenizer_config.json (the model was exported without one). Pass a plain "
                "prompt instead."
            )
        return self.chat_template.render(messages)

    def prompt_ids(
        self,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> list[int]:
        """The checked token ids of exactly one of `prompt`, `prompt_ids` or `messages`."""
        kinds = (("prompt", prompt), ("prompt_ids", prompt_ids), ("messages", messages))
        given = [name for name, value in kinds if value is not None]
        if len(given) != 1:
            raise UserInputError(
                f"give exactly one of a text prompt, prompt ids or chat messages; got {' and '.join(given) or 'none'}."
            )
        if prompt_ids is not None:
            ids = check_token_ids(prompt_ids, "prompt_ids")
        else:
            if prompt is not None and not isinstance(prompt, str):
                raise UserInputError(
                    f"prompt must be a string, got {type(prompt).__name__}; pass token ids as prompt_ids and a chat "
                    "as messages."
                )
            if self.tokenizer is None:
                raise UserInputError(f"the export {self.export.path} has no tokenizer: pass prompt ids instead.")
            if prompt is not None:
                ids = self.tokenizer.encode(prompt)
            else:  # a rendered chat holds its special tokens already (transformers encodes it so too)
                ids = self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False)
        if not ids:
            raise UserInputError("the prompt is empty: give at least one token (a BOS token for an empty text).")
        vocab = self.manifest.spec.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UserInputError(f"prompt ids {bad[:5]} are outside the vocabulary (0..{vocab - 1}).")
        capacity = self.cache.capacity  # max_seq_len, less a spare slot where the graphs write one (kvcache.py)
        if len(ids) > capacity:
            raise UserInputError(
                f"the prompt has {len(ids)} tokens, more than the export's KV cache holds ({capacity} positions, set "
                "by --max-seq-len at export). Shorten the prompt or re-export with a larger --max-seq-len."
            )
        return ids

    def _run(
        self,
        request: Request,
        timeline: Timeline,
        stream: GenerationStream,
        with_text: bool,
        annotate=None,
        exit_policy=None,
    ) -> Iterator[StreamedToken]:
        self._refuse_reentry()  # e.g. zip(model.stream(a), model.stream(b)) in one thread
        self._lock.acquire()
        try:
            self._owner = threading.get_ident()
            with self._state:
                self._check_open()
                self._active = stream
            yield from self._decode(request, timeline, stream, with_text, annotate, exit_policy)
        finally:
            with self._state:
                self._active = None
            self._owner = None
            self._lock.release()

    def _decode(self, request: Request, timeline, stream, with_text, annotate, exit_policy):
        ids, config = request.ids, request.config
        overlap = self.overlap_of(config)
        sampling = config.sampling(config.seed if config.seed is not None else secrets.randbits(63))
        stats = GenerationStats(
            mode=config.mode,
            overlap=overlap if config.mode == "paradecode" else None,
            prompt_tokens=len(ids),
            seed=None if sampling is None else sampling.seed,
        )
        self.cache.reset()
        observe = self.speculation.times.observe
        ctx = DecodeContext(self.backend, self.cache, timeline, annotate=annotate, observe=observe)
        stops = self.stops_of(request, self.cache.capacity)
        if config.mode == "ar":
            decoder = decode_ar(ctx, ids, stops, sampling)
        else:
            settings = dict(stops=stops, stats=stats, exit_policy=exit_policy)
            decoder = self.paradecoder(ctx, ids, request, overlap, sampling, **settings).run()
        completion = Completion(ids, config, self.tokenizer, with_text)
        tokens, margins = completion.tokens, completion.margins
        started = time.perf_counter()
        try:
            for token, margin, stop in decoder:  # the decoder ends after the token it stops at
                if not tokens:
                    stats.prefill_seconds = time.perf_counter() - started
                piece, stop = completion.push(token, margin, stop)
                yield StreamedToken(token, piece)
                if stop == MAX_SEQ_LEN:
                    self._warn_full(len(tokens))
                stats.stop_reason = stop or ("closed" if self._closed else None)
                if stats.stop_reason:
                    break
        except GeneratorExit:
            stats.stop_reason = stats.stop_reason or ("closed" if self._closed else "cancelled")
            raise
        finally:
            decoder.close()
            self.remember(request, tokens)
            stats.seconds = time.perf_counter() - started
            stats.new_tokens = len(tokens)
            stats.lane_busy_seconds = {lane: busy for lane, busy in timeline.busy.items() if lane != "phases"}
            stats.calls = timeline.calls
            stream.result = GenerationResult(
                tokens,
                self.tokenizer.completion(ids, tokens) if self.tokenizer else None,
                stats,
                margins,
                timeline if timeline.record_spans else None,
            )


def load(path: str | Path | ExportFolder, **options) -> ParaDecodeModel:
    """Load an export folder for decoding: `load("out/model", backend="onnxruntime", device="cpu")`; or an export
    already opened (`runtime.loader.open_export`), which several models then share with its checks."""
    return ParaDecodeModel(path, **options)
