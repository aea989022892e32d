"""Stand-in peers for the benchmark's tests (tools/peers.py, tools/peer_process.py): light enough for a child
process to import (only paradecode.tools.peers), and one that crashes its process as llama.cpp's AMX build did."""

from __future__ import annotations

import os
import signal

from paradecode.tools import peers


class CountingPeer(peers.PeerRunner):
    """Emits 100, 101, 102, ... after any prompt; records what it was asked."""

    name = "counting"

    def __init__(self, **common):
        super().__init__(**common)
        self.events = []

    def _load(self):
        self.events.append("load")

    def _tokens(self, ids, budget, stats):
        self.events.append(("decode", len(ids), budget))
        token = 100
        try:
            while True:
                yield token
                token += 1
        finally:
            stats["proposed"], stats["accepted"], stats["rollbacks"] = 3, 2, 1

    def _close(self):
        self.events.append("close")


class CrashingPeer(CountingPeer):
    """A CountingPeer whose `crash_at`-th decode (1: the first) kills its process with SIGSEGV, as llama-cpp-python
    built with AMX kernels did inside llama_decode."""

    name = "crashing"

    def __init__(self, crash_at: int, **common):
        super().__init__(**common)
        self.crash_at = crash_at

    def _tokens(self, ids, budget, stats):
        if sum(isinstance(e, tuple) for e in self.events) + 1 == self.crash_at:
            os.kill(os.getpid(), signal.SIGSEGV)
        yield from super()._tokens(ids, budget, stats)
