"""What a draft head's calls cost on an export, beside a token of plain decoding (issue 58, landing 1).

    python tools/results/cpu-2core/draft-cost.py EXPORT OUT.json

EXPORT: an export with a draft head (`paradecode-export MODEL --draft-head FILE`; an untrained head costs what a
trained one of the same vocabulary does: `make_untrained_draft_head`). On the onnxruntime backend at its default
threads, after a prefill of PROMPT tokens (the draft fed its positions), each round times, REPS calls each at the
newest position (each call writes the same slots again):

- `token`: a token of plain decoding (the embedding, every layer through the export's segments, the final head);
- `chain step`: the embedding of one guessed token and the draft graph on one position (a draft chain's step);
- `feed 3`: the draft graph on 3 positions (the verified positions a verdict hands over, fed before a chain);
- `draft 1`: the draft graph alone on one position; `embed 1`: the embedding alone.

Per call kind, the median over a round's calls, then the median, min and max over ROUNDS rounds; and each one's
share of a token. Nothing else should run on the machine meanwhile.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from paradecode.runtime import load
from paradecode.runtime.decoding import MAIN, DecodeContext, prefill
from paradecode.runtime.tracing import Timeline
from paradecode.runtime.proposers import DraftProposer

PROMPT, REPS, ROUNDS = 200, 20, 7


def main(export: str, out: str) -> None:
    with load(export, backend="onnxruntime") as model:
        backend = model.backend
        layers = backend.spec.num_layers
        ctx = DecodeContext(backend, backend.allocate_cache(), Timeline(record_spans=False))
        draft = DraftProposer(5, layers + 1)
        prompt = torch.randint(0, backend.spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0))
        token, _ = prefill(ctx, prompt.tolist(), draft=draft)
        p = PROMPT  # the newest position
        hidden = draft.pending[:, -3:]
        embedded = ctx.embed(MAIN, [token] * 3, p - 2)

        def plain():
            h = ctx.layers(MAIN, 1, layers, ctx.embed(MAIN, [token], p), p)
            ctx.head(MAIN, "final", h, p)

        calls = {
            "token": plain,
            "chain step": lambda: ctx.draft(MAIN, layers + 1, hidden[:, -1:], ctx.embed(MAIN, [token], p), p),
            "feed 3": lambda: ctx.draft(MAIN, layers + 1, hidden, embedded, p - 2),
            "draft 1": lambda: ctx.draft(MAIN, layers + 1, hidden[:, -1:], embedded[:, -1:], p),
            "embed 1": lambda: ctx.embed(MAIN, [token], p),
        }
        rounds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, call in calls.items():
                times = []
                for _ in range(REPS):
                    began = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - began)
                rounds[name].append(statistics.median(times) * 1e3)
        token_ms = statistics.median(rounds["token"])
        result = {
            "export": export,
            "draft_vocab": backend.manifest.draft["vocab"],
            "kernels": backend.kernels_identity(),
            "prompt": PROMPT,
            "ms": {
                name: {
                    "median": statistics.median(v),
                    "min": min(v),
                    "max": max(v),
                    "of_a_token": statistics.median(v) / token_ms,
                }
                for name, v in rounds.items()
            },
        }
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    for name, row in result["ms"].items():
        print(
            f"{name:<11} {row['median']:7.3f} ms (min {row['min']:.3f}, max {row['max']:.3f})  "
            f"{row['of_a_token']:.3f} of a token"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
