"""`ParaDecodeModel`: load an export once, then generate with `ar` or `paradecode`, whole or streamed.

A model holds what every request shares, and nothing of a request: its `Runtime` (runtime/engine.py: the backend
with the export's graphs and sessions, the tokenizer, the estimates adaptive speculation learns and the outputs
lookup proposes from, each behind its own interface), the chat template, and its `ModelFacts`, what a request is
resolved against (runtime/request.py). A call resolves its request (`request`: checked completely, before anything
is held) and decodes it in an `Engine` of one row over the runtime, as a server's batch does, never calling back
into the model.

Threading model
---------------
A model may be shared by many threads, and their calls decode at the same time, each in an engine of its own (the
backend's calls are thread-safe; each concurrent call costs one more KV cache). The engines a call has finished
with are kept for the next (`_idle`), so a thread that decodes again reuses its cache's memory.

- `_state` (a Condition) guards `_streams` (the streams decoding: begun, not yet ended) and `_idle`, and the
  setting of `runtime.closing`. It is held only to read or change them, never while decoding.
- A stream takes an engine at its first token request (`next()` on it; `generate` does that at once) and gives it
  back when it is exhausted or closed. Several streams of one thread may be open at once.
- The estimates, the shared lookup index and the once-only warnings guard themselves (runtime/speculation.py,
  runtime/lookup.py, runtime/notices.py).
- `close()` sets `runtime.closing` and ends every stream: an idle one at once (from the closing thread), one that
  another thread is computing after its current token (its engine sees the model closing); it waits for them, then
  frees the engines' lanes and the backend. Every later call raises `ModelClosedError`.

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
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from paradecode.graphs.errors import ModelClosedError, ParadecodeError, PromptTooLongError, UserInputError
from paradecode.graphs.manifest import TOKENIZER_DIR
from paradecode.runtime import policy
from paradecode.runtime.backends import backend_class
from paradecode.runtime.chat import ChatTemplate
from paradecode.runtime.config import GenerationConfig, check_token_ids
from paradecode.runtime.engine import CANCELLED, CLOSED, Engine, Runtime, Sequence, StreamedToken, generate_batched
from paradecode.runtime.loader import ExportFolder, open_export
from paradecode.runtime.lookup import SharedSuffixIndex
from paradecode.runtime.notices import Notices
from paradecode.runtime.overlaps import STALL_SECONDS
from paradecode.runtime.request import ModelFacts, Request, resolve
from paradecode.runtime.speculation import Speculation
from paradecode.runtime.stats import GenerationResult
from paradecode.runtime.tokenizer import TextTokenizer
from paradecode.runtime.tracing import NO_TRACING, Tracing

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
        self.files = self.export.files  # what the model was loaded from, compared with its folder (watched.py)
        # What every engine of this model decodes with (runtime/engine.py): the estimates adaptive speculation
        # learns and the outputs lookup proposes from carry over between requests.
        self.runtime = Runtime(
            backend=self.backend,
            tokenizer=self.tokenizer,
            lanes=lanes,
            estimates=Speculation(self.backend.spec.num_layers),
            shared_lookup=SharedSuffixIndex(),
            files=self.files,
            closing=threading.Event(),
            notices=Notices(),
        )
        self.capacity = self.runtime.capacity  # the positions a request may take (a KV cache's slots)
        self.facts = ModelFacts(  # what requests are resolved against (runtime/request.py)
            name=self.export.path.name,
            path=str(self.export.path),
            vocab_size=self.manifest.spec.vocab_size,
            capacity=self.capacity,
            eos=tuple(self.export.eos_token_ids),
            thresholds=dict(self.manifest.thresholds),
            trained_heads=self.manifest.head_kind != "identity",
            draft_head=self.manifest.draft is not None,
            with_logits=self.manifest.with_logits,
            has_tokenizer=self.tokenizer is not None,
            device=self.backend.device.type,
            row_form=self.backend.row_form,
        )
        self._state = threading.Condition()
        self._streams: set[GenerationStream] = set()
        self._idle: list[Engine] = []

    @property
    def manifest(self):
        return self.export.manifest

    @property
    def lanes(self) -> int:
        return self.runtime.lanes

    @property
    def speculation(self) -> Speculation:
        """What decoding has measured of this model's call costs and acceptance (runtime/speculation.py)."""
        return self.runtime.estimates

    @property
    def shared_index(self) -> SharedSuffixIndex:
        """What its requests' outputs continued with, for lookup proposals across requests (runtime/lookup.py)."""
        return self.runtime.shared_lookup

    @property
    def closed(self) -> bool:
        return self.runtime.closing.is_set()

    def close(self) -> None:
        """End every stream (an idle one now, one being computed after its token), then free the engines and the
        backend. Idempotent."""
        with self._state:
            if self.closed:
                return
            self.runtime.closing.set()
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
        template); settings override `config`'s fields. `tracing` (`runtime.tracing.Tracing`) is for measuring tools:
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
        """Check the request completely (a bad one raises here, before it holds the model), then make its stream
        (whether the export is still its folder's is checked where it starts: `Engine.join`)."""
        self._check_open()
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
        does this before it listens); shapes it did not meet still compile at their first use. Each of its requests
        decodes over a runtime of fresh estimates (no costs known: each step takes every proposal until the costs it
        measures decide), shared lookup and muted warnings of its own, so the kinds of call it makes first do not
        depend on timing, and nothing it measures or says reaches the user's requests, which may be decoding
        meanwhile."""
        config = config or GenerationConfig()
        length = max(1, min(8, self.capacity // 2))
        # repeated: lookup proposes from the first step on (the prompt's last tokens occur earlier in it)
        prompt = [t % self.backend.spec.vocab_size for t in (1, 2, 3) * 3][:length]
        settings = dict(max_new_tokens=length, ignore_eos=True, lookup_shared=False)

        def fresh() -> Runtime:
            # estimates that know no costs yet: every step takes every proposal, so the kinds of call the warm-up
            # makes do not depend on how fast its first calls ran (costs measured there that declined a batch's
            # proposals left the call of several rows of several positions to compile in the first requests)
            return replace(
                self.runtime,
                estimates=Speculation(self.backend.spec.num_layers),
                shared_lookup=SharedSuffixIndex(),
                notices=Notices.muted(),
            )

        one = self._engine()  # the engine the next call takes: its CUDA graphs (by its cache's address) are warm
        engines = [one] if engine is None else [one, engine]
        saved = [(e, e.runtime) for e in engines]
        try:
            for extra in ({"mode": "ar"}, {}, {"thresholds": 0.0}):  # thresholds 0: every token exits
                one.runtime = fresh()
                request = self._resolve(replace(config, **settings, **extra), prompt)
                generate_batched(one.runtime, [request], engine=one)
            if engine is not None:
                rows = range(engine.rows)
                for extra in ({"mode": "ar"}, {}):  # one position a row; then each row's proposals too
                    engine.runtime = fresh()
                    requests = [
                        self._resolve(replace(config, **settings, **extra), prompt[: max(1, length - i)]) for i in rows
                    ]
                    generate_batched(engine.runtime, requests, engine=engine)
        finally:
            for each, original in saved:
                each.runtime = original
            self._release(one)

    def request(
        self,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        config: GenerationConfig | None = None,
        **settings,
    ) -> Request:
        """A request resolved completely against this model (runtime/request.py; a bad one raises UserInputError
        here): its prompt's token ids, its settings as they will run and everything derived from them. The warnings
        its settings call for are said once per model."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise UserInputError(f"config must be a GenerationConfig, got {type(config).__name__}.")
        config = replace(config or GenerationConfig(), **settings) if settings else (config or GenerationConfig())
        request = self._resolve(config, self.prompt_ids(prompt, prompt_ids, messages))
        for name, args in request.warnings:
            self.runtime.notices.say(name, *args)
        return request

    def _resolve(self, config: GenerationConfig, ids: list[int]) -> Request:
        return resolve(self.facts, config, ids, secrets.randbits(63))

    def overlap_of(self, config: GenerationConfig) -> str:
        """The request's overlap with `auto` resolved for this model's device."""
        return config.overlap if config.overlap != "auto" else policy.auto_overlap(self.backend.device.type)

    # --- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
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
        *,
        max_text_bytes: int | None = None,
    ) -> list[int]:
        """The checked token ids of exactly one of `prompt`, `prompt_ids` or `messages`. `max_text_bytes`: a text (or
        a rendered chat) of more bytes is refused before it is tokenized (PromptTooLongError): a server's bound on
        the work an untrusted prompt may cost, set where no prompt of more bytes fits the context."""
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
                raise UserInputError(
                    f"{self.export.path} has no tokenizer: send the prompt as a list of token ids (prompt_ids), not as "
                    "text or a chat."
                )
            text = prompt if prompt is not None else self.render_chat(messages)
            size = len(text.encode("utf-8", "surrogatepass"))
            if max_text_bytes is not None and size > max_text_bytes:
                raise PromptTooLongError(
                    f"the prompt has {size} bytes of text, and this model's context (the export's max_seq_len) is "
                    f"{self.capacity} tokens, which hold at most {max_text_bytes} bytes. Shorten the prompt, or "
                    "re-export the model with a larger --max-seq-len."
                )
            # a rendered chat holds its special tokens already (transformers encodes it so too)
            ids = self.tokenizer.encode(text, add_special_tokens=prompt is not None)
        return ids

    def _engine(self) -> Engine:
        """An engine of one row for a call: an idle one, else a new one."""
        with self._state:
            if self._idle:
                return self._idle.pop()
        return Engine(self.runtime, 1)

    def _release(self, engine: Engine) -> None:
        """Keep a call's engine for the next call (free it once the model is closed)."""
        with self._state:
            if not self.closed:
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
        sequence = Sequence.of(request, events.append, self.runtime, with_text=with_text, tracing=tracing)
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
                    engine.leave(sequence, CLOSED if self.closed else CANCELLED)
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
