"""`ParaDecodeModel`: load an export once, then generate with `ar` or `paradecode`, whole or streamed.

A model holds what every request shares: the export's graphs and their sessions (the backend), the tokenizer and
chat template, the estimates adaptive speculation learns (runtime/speculation.py) and the outputs lookup proposes
from (`SharedSuffixIndex`). Nothing of a request: each call decodes in an `Engine` of one row (runtime/engine.py)
that holds its KV cache, and its request is a `Sequence` there, as in a server's batch.

Threading model
---------------
A model may be shared by many threads, and their calls decode at the same time, each in an engine of its own (the
backend's calls are thread-safe; each concurrent call costs one more KV cache). The engines a call has finished
with are kept for the next (`_idle`), so a thread that decodes again reuses its cache's memory.

- `_state` (a Condition) guards `_closed`, `_streams` (the streams decoding: begun, not yet ended) and `_idle`.
  It is held only to read or change them, never while decoding.
- A stream takes an engine at its first token request (`next()` on it; `generate` does that at once) and gives it
  back when it is exhausted or closed. Several streams of one thread may be open at once.
- The estimates and the shared lookup index are updated by every engine: the index locks itself; an estimate is a
  running average that a concurrent update may leave one sample short, which only shifts a speculation decision.
- `close()` marks the model closed and ends every stream: an idle one at once (from the closing thread), one that
  another thread is computing after its current token (its engine sees the model closed); it waits for them, then
  frees the engines' lanes and the backend. Every later call raises `ModelClosedError`.

A failed request (bad input, an error while decoding, a stopped stream) leaves the model usable. The model
computes with the export as it read it at load, whatever happens to its folder later; once the folder no longer
holds those files (compared by content), every call refuses with `ExportChangedError` before it starts, and
a stream already decoding finishes (runtime/watched.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from paradecode.graphs.errors import ModelClosedError, ParadecodeError, UserInputError
from paradecode.graphs.manifest import TOKENIZER_DIR
from paradecode.runtime import policy
from paradecode.runtime.backends import backend_class
from paradecode.runtime.chat import ChatTemplate
from paradecode.runtime.completion import Stops
from paradecode.runtime.config import GenerationConfig, check_token_ids
from paradecode.runtime.decoding import DecodeContext, Executor
from paradecode.runtime.engine import CANCELLED, CLOSED, Engine, Request, Sequence, StreamedToken, generate_batched
from paradecode.runtime.lanes import NO_TRACING, Lane, Tracing
from paradecode.runtime.loader import ExportFolder, open_export
from paradecode.runtime.lookup import SharedSuffixIndex
from paradecode.runtime.overlaps import STALL_SECONDS, ThreadedExecutor
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationResult, GenerationStats
from paradecode.runtime.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


class GenerationStream:
    """Iterate to receive tokens as they are verified; `result` holds everything once iteration ends.

    A stream holds an engine (a KV cache) from its first token until it is exhausted or closed: stop early with
    `close()` (or use it as a context manager) so that the next call reuses it.
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


# What a request's settings make a model say once (`ParaDecodeModel._say_once`), by name.
WARNINGS = {
    "untrained": "%s has no trained exit heads, so ParaDecode does not exit early by default and decodes like ar "
    "(the model's own head at an intermediate layer rarely agrees with the last layer). Train heads with "
    "`paradecode-train-heads MODEL -o heads.safetensors` and export with --heads, or pass thresholds to exit with the "
    "model's own head anyway.",
    "inexact": "ParaDecode requests on %s decode as plain decoding (mode 'ar') on this machine: its kernels give a "
    "position other bits in a call of several positions than in a call of its own, so verifying several at once "
    "would change the output (runtime/row_exactness.py). Re-export with other --activations or --weights to try "
    "another form.",
    "alone": "ParaDecode requests on %s decode as plain decoding (mode 'ar') with the default speculation on this "
    "machine: to keep plain decoding's output its kernels compute every position in a call of its own "
    "(runtime/row_exactness.py), so in the batched overlap verifying a proposed or exited token costs a whole pass "
    "and no speculation can pay (measured: tools/results/cpu-2core/bench-smollm2-default-s12-adaptive-lookup.md). "
    "An export with --activations int8 verifies several positions in one call; pass thresholds or adaptive=False "
    "(--adaptive off) to speculate anyway.",
    "idle": "ParaDecode here has nothing to speculate: with the export's thresholds it calls no exit heads %s "
    "(measured not to pay: `GenerationConfig.skips_exits`), and lookup is off. Decode with mode 'ar' (it is faster), "
    "turn lookup on, or pass thresholds or adaptive=False (--adaptive off) to use the exit heads anyway.",
    "full": "stopped after %d new tokens: the KV cache is full (max_seq_len %d). Re-export with a larger "
    "--max-seq-len for longer outputs.",
}


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
        int4_kernels: bool = False,
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
        if int4_kernels and backend != "torch":
            raise UserInputError(
                f"int4_kernels reads 4-bit weights with torch's int4 kernels; the {backend!r} backend runs the "
                "export's own graphs. Use backend='torch' (--backend torch), or leave int4_kernels unset."
            )
        options = {}
        if backend == "onnxruntime":
            # None: every core per call (onnxruntime_backend's THREADS, measured); lane 0 alone computes in ar and in
            # `batched` (a CPU's default).
            options["threads"] = threads
        elif backend == "torch":
            options["cuda_graphs"] = cuda_graphs
            options["torch_compile"] = torch_compile
            options["int4_kernels"] = int4_kernels
        self.backend = backend_class(backend)(self.export, device=device, **options)
        self.lanes = lanes  # per engine: the decoding thread and lanes - 1 side lanes (`streams` and `both`)
        self.capacity = self.backend.cache_capacity  # the positions a request may take (a KV cache's slots)
        # What decoding has measured of this model's call costs and acceptance: carried over between requests.
        self.speculation = Speculation(self.backend.spec.num_layers)
        # What its requests' outputs continued with, for lookup proposals across requests (runtime/lookup.py).
        self.shared_index = SharedSuffixIndex()
        self.files = self.export.files  # what the model was loaded from, compared with its folder (watched.py)
        self._state = threading.Condition()
        self._closed = False
        self._streams: set[GenerationStream] = set()
        self._idle: list[Engine] = []
        self._said: set[str] = set()  # the once-per-model warnings given (`_say_once`)

    @property
    def manifest(self):
        return self.export.manifest

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End every stream (an idle one now, one being computed after its token), then free the engines and the
        backend. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + STALL_SECONDS
        with self._state:
            while self._streams:
                for stream in list(self._streams):
                    # An idle stream (between two tokens) ends now, from this thread. One that another thread is
                    # computing raises ValueError ("generator already executing"): its engine ends it at its next
                    # step (it sees the model closed), or this loop closes it once it is idle.
                    self._state.release()
                    try:
                        with contextlib.suppress(ValueError):
                            stream.close()
                    finally:
                        self._state.acquire()
                if time.monotonic() > deadline:
                    raise ParadecodeError(
                        f"close() waited {STALL_SECONDS:g} s for the running calls to end; the model was not freed."
                    )
                self._state.wait(0.05)
            idle, self._idle = self._idle, []
        for engine in idle:
            engine.free()
        self.backend.close()

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
        tracing: Tracing | None = None,
        **settings,
    ) -> GenerationResult:
        """Decode after `prompt` (text), `prompt_ids` or `messages` (a chat, rendered with the export's chat
        template); settings override `config`'s fields. `tracing` (`runtime.lanes.Tracing`) is for measuring tools:
        spans of every call in `result.timeline`, NVTX-style annotations, an exit policy; it never changes the
        output."""
        stream = self._stream(prompt, prompt_ids, messages, config, tracing, settings, text=False)
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
        tracing: Tracing | None = None,
        **settings,
    ) -> GenerationStream:
        """Like `generate`, but yields each token as soon as it is verified."""
        return self._stream(prompt, prompt_ids, messages, config, tracing, settings, text=True)

    def _stream(
        self, prompt, prompt_ids, messages, config, tracing: Tracing | None, settings: dict, *, text: bool
    ) -> GenerationStream:
        """Check the request completely (a bad one raises here, before it holds the model), then make its stream."""
        self._check_open()
        self.files.check()
        request = self.request(prompt, prompt_ids, messages, config, **settings)
        stream = GenerationStream()
        if tracing is not None and not isinstance(tracing, Tracing):
            raise UserInputError(f"tracing must be a paradecode.runtime.Tracing, got {type(tracing).__name__}.")
        stream._tokens = self._run(request, tracing or NO_TRACING, stream, text)
        return stream

    def warm_up(self, config: GenerationConfig | None = None, engine: Engine | None = None) -> None:
        """Decode a few tokens in the kinds of call decoding makes (a prefill; one position; several, as exits
        and lookup proposals do; with `engine`, a server's engine of several rows, several requests in one call),
        with `config`'s settings (a server's: sampling, overlap, K) and with every token exiting. With
        `torch_compile`, the modules compile now rather than in the first requests (`paradecode-serve --compile`
        does this before it listens); shapes it did not meet still compile at their first use. What the warm-up
        measures does not reach the adaptive speculation, and its outputs not the shared lookup."""
        config = config or GenerationConfig()
        length = max(1, min(8, self.capacity // 2))
        prompt = [t % self.backend.spec.vocab_size for t in (1, 2, 3) * 3][:length]  # repeated: lookup proposes
        settings = dict(config=config, max_new_tokens=length, ignore_eos=True, lookup_shared=False)
        one = self._engine()  # the engine the next call takes: its CUDA graphs (by its cache's address) are warm
        engines = [one] if engine is None else [one, engine]
        saved, self._said = self._said, set(WARNINGS)  # said by requests, not the warm-up
        for each in engines:
            each.speculation = Speculation(self.backend.spec.num_layers)
        try:
            for extra in ({"mode": "ar"}, {}, {"thresholds": 0.0}):  # thresholds 0: every token exits
                generate_batched(self, [self.request(prompt_ids=prompt, **settings, **extra)], engine=one)
            if engine is not None:
                rows = range(engine.rows)
                requests = [self.request(prompt_ids=prompt[: max(1, length - i)], **settings) for i in rows]
                generate_batched(self, requests, engine=engine)
        finally:
            for each in engines:
                each.speculation = self.speculation
            self._said = saved
            self._release(one)

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
        form = self.backend.row_form
        # Decoded as plain decoding: where ParaDecode could not keep plain decoding's output ("inexact"), and where
        # every position has a call of its own, so on one lane no speculation can pay ("alone")
        alone = form is not None and form.alone
        if config.mode == "paradecode" and form is None:
            self._say_once("inexact", self.export.path.name)
            config = replace(config, mode="ar")
        if config.mode == "paradecode" and config.decodes_plainly(alone, self.overlap_of(config)):
            self._say_once("alone", self.export.path.name)
            config = replace(config, mode="ar")
        thresholds = {}
        if config.mode == "paradecode":
            device, overlap = self.backend.device.type, self.overlap_of(config)
            thresholds = config.resolve_thresholds(self.manifest.thresholds, device, overlap)
            if config.skips_exits(device, overlap) and not config.lookup_tokens:
                self._say_once("idle", "on CUDA" if device == "cuda" else "when sampling on a CPU")
        if config.mode == "paradecode" and config.thresholds is None and self.manifest.head_kind == "identity":
            self._say_once("untrained", self.export.path)
        return Request(ids, config, thresholds)

    def paradecoder(
        self,
        ctx: DecodeContext,
        ids: list[int],
        request: Request,
        overlap: str | None,
        sampling,
        *,
        stops: Stops,
        stats: GenerationStats,
        side_lanes: list[Lane] = (),
        speculation: Speculation | None = None,
        exit_policy=None,
    ) -> Executor:
        """ParaDecode of `request` after `ids` (its prompt, or everything verified so far when an engine hands a
        request back to ParaDecode) over `ctx` until `stops` (the request's), with `side_lanes` beside the calling
        thread (for `streams` and `both`) and `speculation`'s estimates (the model's by default), counting into
        `stats`. `overlap`: the request's (None: its config's, `auto` resolved for this device); `exit_policy`: its
        `Tracing`'s."""
        config = request.config
        overlap = overlap or self.overlap_of(config)
        adaptive = config.adapts(self.backend.device.type, overlap) and exit_policy is None
        lanes = list(side_lanes) if overlap in ("streams", "both") else []
        executor, more = (ThreadedExecutor, {"side_lanes": lanes}) if lanes else (Executor, {})
        return executor.of(
            ctx,
            ids,
            stops,
            stats,
            thresholds=request.thresholds,
            max_unverified=config.max_unverified,
            merge=overlap in ("batched", "both"),
            exit_policy=exit_policy,
            lookup=config.lookup_config(),
            shared=self.shared_index if config.lookup_shared else None,
            sampling=sampling,
            speculation=(speculation or self.speculation) if adaptive else None,
            **more,
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
    def _say_once(self, what: str, *args) -> None:
        """Log the warning `WARNINGS[what]` (formatted with `args`) the first time this model meets it."""
        if what not in self._said:
            self._said.add(what)
            logger.warning(WARNINGS[what], *args)

    def warn_full(self, new_tokens: int) -> None:
        self._say_once("full", new_tokens, self.manifest.max_seq_len)  # every result says so in stats.stop_reason

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError("this model is closed: load the export again to decode with it.")

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
        capacity = self.capacity  # max_seq_len, less a spare slot where the graphs write one (kvcache.py)
        if len(ids) > capacity:
            raise UserInputError(
                f"the prompt has {len(ids)} tokens, more than the export's KV cache holds ({capacity} positions, set "
                "by --max-seq-len at export). Shorten the prompt or re-export with a larger --max-seq-len."
            )
        return ids

    def _engine(self) -> Engine:
        """An engine of one row for a call: an idle one, else a new one."""
        with self._state:
            if self._idle:
                return self._idle.pop()
        return Engine(self, 1)

    def _release(self, engine: Engine) -> None:
        """Keep a call's engine for the next call (free it once the model is closed)."""
        with self._state:
            if not self._closed:
                self._idle.append(engine)
                return
        engine.free()

    def _run(
        self,
        request: Request,
        tracing: Tracing,
        stream: GenerationStream,
        with_text: bool,
    ) -> Iterator[StreamedToken]:
        events: deque = deque()  # what the engine hands the sequence: its tokens, then its result or an error
        sequence = Sequence(request, events.append, with_text=with_text, tracing=tracing)
        with self._state:
            self._check_open()
            self._streams.add(stream)
        engine = None
        try:
            engine = self._engine()
            engine.join(sequence)
            while True:
                while events:
                    event = events.popleft()
                    if isinstance(event, StreamedToken):
                        yield event
                    elif isinstance(event, GenerationResult):
                        stream.result = event
                        return
                    else:
                        raise event
                engine.step()
        finally:
            if engine is not None:
                if sequence in engine.sequences:  # stopped before its end: closed, or by the model's closing
                    engine.leave(sequence, CLOSED if self._closed else CANCELLED)
                self._release(engine)
            if stream.result is None:
                stream.result = next((e for e in events if isinstance(e, GenerationResult)), None)
            with self._state:
                self._streams.discard(stream)
                self._state.notify_all()


def load(path: str | Path | ExportFolder, **options) -> ParaDecodeModel:
    """Load an export folder for decoding: `load("out/model", backend="onnxruntime", device="cpu")`; or an export
    already opened (`runtime.loader.open_export`), which several models then share with its checks."""
    return ParaDecodeModel(path, **options)
