"""`Service`: one server's replicas, metrics and request preparation, without HTTP.

`prepare` turns a parsed request into a resolved `Request` (runtime/request.py: it renders chats, tokenizes and
checks everything, so a bad request is answered before it is queued, and the replica that decodes it checks nothing
again); `prepare_body` parses a body and prepares it in the service's own preparation threads
(`prepare_threads` at once, whatever the number of requests, never on the event loop; runtime/serve/preparing.py:
the smallest body first, at most `max_preparing_bytes` of large bodies waiting or in work and as many of small
ones, 429 beyond); `submit` queues the job. Preparing reads only the tokenizer, chat template and manifest
of a replica, which decoding never changes, so it may run while that replica decodes.

A prompt's text is measured in bytes before it is tokenized: more than `max_prompt_bytes` cannot fit
the context (a token stands for at most the bytes of its longest vocabulary entry), so it gets its
413 without the tokenizer's work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from functools import partial

from paradecode.graphs.errors import PromptError, PromptTooLongError, SettingError, UserInputError
from paradecode.runtime.model import ParaDecodeModel
from paradecode.runtime.request import Request
from paradecode.runtime.serve.bodies import REQUEST_FIELDS, GenerationRequest, parse_request
from paradecode.runtime.serve.config import ServeConfig
from paradecode.runtime.serve.errors import (
    ModelNotFound,
    PromptTooLong,
    RequestError,
    RequestTimeout,
    without_export_path,
)
from paradecode.runtime.serve.metrics import Metrics
from paradecode.runtime.serve.pool import Job, ReplicaPool
from paradecode.runtime.serve.preparing import Preparer
from paradecode.runtime.stops import Stops

logger = logging.getLogger(__name__)

# A normalizer may shrink a text before it is split into tokens (Unicode composition: "e" + U+0301 -> "é"):
# the byte bound leaves this factor of room for it.
NORMALIZER_ROOM = 4


class Service:
    """Loads `config.replicas` models at once; `close()` (or leaving `with`) frees them."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.started = time.time()
        self.metrics = Metrics(config.replicas)
        self.pool = ReplicaPool(config, self.metrics)
        self.metrics.declare_exit_layers(self.reference.manifest.exit_layers)
        tokenizer = self.reference.tokenizer
        # The most UTF-8 bytes a prompt that fits the context can have; None without a tokenizer (no text prompts).
        self.max_prompt_bytes = (
            self.capacity * tokenizer.longest_token_bytes() * NORMALIZER_ROOM if tokenizer is not None else None
        )
        self.preparer = Preparer(config.prepare_threads, config.max_preparing_bytes, config.retry_after)

    @property
    def reference(self) -> ParaDecodeModel:
        """A replica whose tokenizer, template and manifest stand for all (they load the same export)."""
        return self.pool.models[0]

    @property
    def capacity(self) -> int:
        return self.reference.capacity  # max_seq_len, less a spare slot where the graphs write one

    def close(self) -> None:
        self.pool.close()
        self.preparer.close()

    def check_export(self) -> None:
        """Raise ExportChangedError while the served folder does not hold the export the replicas loaded (compared by
        content: runtime/watched.py; the replicas share one opened export)."""
        self.reference.files.check()

    async def prepare_body(self, kind: type[GenerationRequest], body: bytes, deadline: float):
        """(the parsed request, its resolved Request) from a body, in the preparation threads; 429 where the bodies
        waiting for them are too many bytes already, 504 past `deadline` (a time.monotonic()). A request that times
        out while waiting for a thread is dropped from their queue."""
        work = self.preparer.run(len(body), partial(self._parse_and_prepare, kind, body))
        try:
            return await asyncio.wait_for(work, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"the request was not prepared within {self.config.request_timeout:g} s (the server's request "
                "timeout, reading and tokenizing the prompt included) and was dropped. Retry when the server is less "
                "busy."
            ) from None
        except Exception as err:  # the runtime's errors name the export's files by their paths on this disk
            public = without_export_path(err, self.config.export)
            if public is err:
                raise
            raise public from err

    def _parse_and_prepare(self, kind: type[GenerationRequest], body: bytes):
        parsed = parse_request(kind, body)
        return parsed, self.prepare(parsed)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prepare(self, request: GenerationRequest) -> Request:
        """`request` resolved against the served model (its prompt's ids, its settings as they will decode), or the
        error its client gets (404, 413, 400). Whether the export is still its folder's is checked once, where its
        sequence starts (runtime/engine.py `Engine.join`: 503 `export_changed`), as for every caller."""
        name = self.config.served_model_name
        if request.model != name:
            raise ModelNotFound(f"the model {request.model!r} does not exist: this server serves {name!r}.", "model")
        request.check_supported()
        prompt = request.prompt_kwargs()
        param = "messages" if "messages" in prompt else "prompt"
        ids = self._prompt_ids(prompt, param)
        # The prompt's length is checked where the request resolves (runtime/request.py `check_prompt`), as for
        # every caller; past the cache no room is left, and the resolving below refuses it with its message
        room = Stops.room(len(ids), self.capacity)
        asked, field = request.requested_max_tokens()
        if asked is not None and 0 < room < asked:
            raise RequestError(
                f"{field} {asked} is more than this model's context leaves: the export's KV cache holds "
                f"{self.capacity} tokens and the prompt takes {len(ids)}, so at most {room} new tokens (the last "
                "one is never stored). Ask for fewer.",
                field,
            )
        default = request.default_max_tokens(self.config.completion_max_tokens)
        max_new = asked if asked is not None else max(1, min(room, default if default is not None else room))
        try:
            config = replace(self.config.generation, max_new_tokens=max_new, **request.config_settings())
            return self.reference.request(prompt_ids=ids, config=config)
        except PromptTooLongError as err:
            raise PromptTooLong(str(err), param) from err
        except PromptError as err:
            raise RequestError(str(err), param) from err
        except SettingError as err:  # named by the request's field
            raise RequestError(str(err), REQUEST_FIELDS.get(err.setting, err.setting)) from err
        except UserInputError as err:
            raise RequestError(str(err)) from err

    def _prompt_ids(self, prompt: dict, param: str) -> list[int]:
        """The prompt's token ids, as the runtime makes them (`ParaDecodeModel.prompt_ids`), with the text's bytes
        bounded before it is tokenized; before the length check, so a long prompt gets 413, not 400."""
        try:
            return self.reference.prompt_ids(**prompt, max_text_bytes=self.max_prompt_bytes)
        except PromptTooLongError as err:
            raise PromptTooLong(str(err), param) from err
        except UserInputError as err:
            raise RequestError(str(err), param) from err

    def submit(self, request: Request, arrived: float) -> Job:
        """Queue a resolved request; on the event loop (the job's tokens come back to it)."""
        job = Job(request, asyncio.get_running_loop(), arrived)
        self.pool.submit(job)
        return job
