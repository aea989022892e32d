"""The warnings a loaded model gives once: what a request's settings or its decoding make the model say.

A resolved request carries the names of the warnings its settings call for (runtime/request.py); an engine says
`full` when a sequence fills its KV cache. Each is logged the first time the model meets it (`Notices.say`), then
never again: a server's thousandth request that decodes as plain decoding for the same reason says nothing new.

Threading model: `say` may be called from any thread (every engine of a model shares its notices); `_lock` guards
`_said`. `muted()` gives notices that say nothing (a warm-up's requests are not the user's).
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("paradecode.runtime.model")

MESSAGES = {
    "untrained": "%s has no trained exit heads, so ParaDecode does not exit early by default (the model's own head "
    "at an intermediate layer rarely agrees with the last layer); it still proposes tokens by prompt lookup (and by "
    "the export's draft head, where draft_tokens asks), verified by the final layer as every proposal is. Train "
    "heads with `paradecode-train-heads MODEL -o heads.safetensors` and export with --heads, or pass thresholds to "
    "exit with the model's own head anyway.",
    "untrained_no_lookup": "%s has no trained exit heads, so ParaDecode does not exit early by default (the model's "
    "own head at an intermediate layer rarely agrees with the last layer), and with lookup and the draft head off it "
    "proposes nothing: it decodes like ar. Turn lookup on, train heads with `paradecode-train-heads MODEL -o "
    "heads.safetensors` and export with --heads, or pass thresholds to exit with the model's own head anyway.",
    "inexact": "ParaDecode requests on %s decode as plain decoding (mode 'ar') on this machine: its kernels give a "
    "position other bits in a call of several positions than in a call of its own, so verifying several at once "
    "would change the output (runtime/row_exactness.py). Re-export with other --activations or --weights to try "
    "another form.",
    "alone": "ParaDecode requests on %s decode as plain decoding (mode 'ar') with the default speculation on this "
    "machine: to keep plain decoding's output its kernels compute every position in a call of its own "
    "(runtime/row_exactness.py: float activations in the layers), so verifying a proposed or exited token costs a "
    "whole pass and no speculation can pay. An export with --activations int8 (the default) verifies several "
    "positions in one call; pass thresholds or adaptive=False (--adaptive off) to speculate anyway.",
    "idle": "ParaDecode here has nothing to speculate: with the export's thresholds it calls no exit heads %s "
    "(measured not to pay: `GenerationConfig.skips_exits`), and lookup and the draft head are off. Decode with mode "
    "'ar' (it is faster), turn lookup on, or pass thresholds or adaptive=False (--adaptive off) to use the exit heads "
    "anyway.",
    "full": "stopped after %d new tokens: the KV cache is full (max_seq_len %d). Re-export with a larger "
    "--max-seq-len for longer outputs.",
}


class Notices:
    """One model's once-only warnings (`MESSAGES`), said through the model's logger."""

    def __init__(self, quiet: bool = False):
        self._said: set[str] = set(MESSAGES) if quiet else set()
        self._lock = threading.Lock()

    def say(self, name: str, *args) -> None:
        """Log `MESSAGES[name]` formatted with `args`, the first time this model meets it."""
        with self._lock:
            if name in self._said:
                return
            self._said.add(name)
        logger.warning(MESSAGES[name], *args)

    @staticmethod
    def muted() -> Notices:
        return Notices(quiet=True)
