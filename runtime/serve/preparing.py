"""`Preparer`: request bodies parsed and tokenized in threads, never on the event loop, with bounded work.

Preparing a request (parsing its JSON, rendering its chat, tokenizing its text) costs time in proportion to its
body: about a second per MB of text on one core. A server that took every body under its size limit would let a
flood of large prompts queue minutes of it (24 prompts of 660 KB made a small request wait 6 s). So:

- admission: the large bodies (over SMALL_BODY_BYTES) being prepared or waiting for a thread hold at most
  `max_bytes` bytes together (ServeConfig.max_preparing_bytes), and the small ones as many of their own, so that a
  flood of large prompts never refuses a small request; a body that would pass its bound is refused at once,
  before any of its work, with 429 and Retry-After (`QueueFull`, as a full replica queue is);
- order: a free thread takes the smallest waiting body, so a small request waits for a thread, never for a queue
  of large prompts; and large bodies take at most `threads - 1` threads where there are two or more, so that one
  stays free for small requests while large ones are tokenized.

The tokenizer releases the GIL while it encodes (runtime/tokenizer.py), so the event loop (and `/health`) runs
while the threads work.

Threading model
---------------
`run` is called on the event loop, and only the event loop touches `_waiting`, `_bytes`, `_running` and
`_running_large`: a thread runs its body's `work` alone, and its end comes back to the loop as the completion of an
asyncio future (`asyncio.wrap_future`), whose callback releases the body's bytes and thread. A request that gives up
(its timeout, its client leaving) leaves the queue at once; one whose work has begun holds its bytes and thread
until the work ends, since a thread cannot be stopped half-way.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from paradecode.runtime.serve.errors import QueueFull

T = TypeVar("T")

SMALL_BODY_BYTES = 64 << 10  # a chat of a few turns has a few KB; a body over this is a large prompt


@dataclass(order=True)
class _Waiting:
    size: int
    arrival: int  # among bodies of one size, the first come goes first
    turn: asyncio.Future = field(compare=False)  # done when a thread is this body's (or when it gave up)
    started: bool = field(default=False, compare=False)

    @property
    def large(self) -> bool:
        return self.size > SMALL_BODY_BYTES


class Preparer:
    """`threads` threads for preparing bodies: at most `max_bytes` bytes of large ones waiting or in work together,
    and as many of small ones."""

    def __init__(self, threads: int, max_bytes: int, retry_after: int):
        self.threads = threads
        self.max_bytes = max_bytes
        self.retry_after = retry_after
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="paradecode-prepare")
        self._waiting: list[_Waiting] = []  # a heap: the smallest body first
        self._arrivals = itertools.count()
        self._bytes = {False: 0, True: 0}  # of the small and the large bodies admitted and not yet prepared
        self._running = 0  # bodies being prepared (threads taken)
        self._running_large = 0

    @property
    def waiting_bytes(self) -> int:
        """The bytes of the bodies being prepared or waiting for a thread."""
        return sum(self._bytes.values())

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """`work()` in a thread, once a thread is free for a body of `size` bytes; QueueFull (429) at once where
        that body would take the bytes waiting past `max_bytes`."""
        waiting = _Waiting(size, next(self._arrivals), asyncio.get_running_loop().create_future())
        held = self._bytes[waiting.large]
        if held + size > self.max_bytes:
            kind = f"over {SMALL_BODY_BYTES >> 10} KiB" if waiting.large else f"of {SMALL_BODY_BYTES >> 10} KiB or less"
            raise QueueFull(
                f"the request bodies {kind} waiting to be parsed and tokenized hold {held:,} bytes, and this one's "
                f"{size:,} would take them past this server's bound (--max-preparing-bytes {self.max_bytes:,}); "
                f"retry after {self.retry_after} s."
            )
        self._bytes[waiting.large] += size
        heapq.heappush(self._waiting, waiting)
        self._start_waiting()
        try:
            await waiting.turn
            future = asyncio.wrap_future(self._executor.submit(work))
        except BaseException:  # it gave up while waiting (a timeout, the client leaving), or the server closed
            if waiting.started:
                self._release(waiting)
            else:
                if waiting in self._waiting:
                    self._waiting.remove(waiting)
                    heapq.heapify(self._waiting)
                self._bytes[waiting.large] -= size
            raise
        future.add_done_callback(lambda done: self._finished(waiting, done))
        return await asyncio.shield(future)  # giving up leaves the work to end in its thread, holding its place

    def _may_start(self, waiting: _Waiting) -> bool:
        if self._running >= self.threads:
            return False
        return not waiting.large or self.threads == 1 or self._running_large < self.threads - 1

    def _start_waiting(self) -> None:
        """Give free threads to the smallest waiting bodies (a large one waits while only the small ones' thread
        is free; every body behind it is large too)."""
        while self._waiting and self._may_start(self._waiting[0]):
            waiting = heapq.heappop(self._waiting)
            if waiting.turn.done():  # cancelled: its request gave up, and finds it out of the queue
                continue
            waiting.started = True
            self._running += 1
            self._running_large += waiting.large
            waiting.turn.set_result(None)

    def _finished(self, waiting: _Waiting, done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()  # read here: a request that gave up no longer reads its outcome
        self._release(waiting)

    def _release(self, waiting: _Waiting) -> None:
        self._bytes[waiting.large] -= waiting.size
        self._running -= 1
        self._running_large -= waiting.large
        self._start_waiting()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
