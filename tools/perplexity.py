"""`paradecode-perplexity EXPORT [EXPORT ...]`: each export's perplexity on the same held-out text, teacher-forced.

What an export format costs in quality, measured on the exports themselves (their graphs, on this machine's
onnxruntime), not on a simulation of their numerics: the text is tokenized once (the first export's tokenizer;
every export must share its vocabulary), cut into windows of `--window` tokens, and each window runs as one prefill
(every layer, then the final head's logits at every position); a window's first token is context only, every
other is scored by the log-probability the logits give it. Perplexity is exp of the mean negative log-probability
over every scored token; an export's figure beside the first one's is their ratio.

The default text is the held-out `eval` prompt set's (export/data/eval_chat.jsonl and HumanEval's held-out
problems: written for this project, never used to train heads or choose defaults), every prompt's content joined
by blank lines; `--text FILE` reads a UTF-8 file instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from paradecode.graphs.errors import UserInputError, run_command
from paradecode.graphs.manifest import read_manifest

DEFAULT_TEXT = "eval"
DEFAULT_TOKENS = 6144
DEFAULT_WINDOW = 512


@dataclass(frozen=True)
class Perplexity:
    export: str
    format: str  # weights and activations, as the manifest records them
    tokens: int  # scored
    windows: int
    perplexity: float
    seconds: float


def text_of(source: str) -> str:
    """The held-out prompt set's text by its name (`eval`), else a UTF-8 file's."""
    if source == DEFAULT_TEXT:
        from paradecode.export.prompt_sets import load_prompts

        parts = []
        for labelled in load_prompts(source):
            prompt = labelled.prompt
            parts += [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        return "\n\n".join(parts)
    path = Path(source)
    if not path.is_file():
        raise UserInputError(f"--text {source}: no such file; give a UTF-8 text file, or `eval` for the held-out set.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserInputError(f"--text {source} is not UTF-8 text ({err}).") from err


def format_of(export: Path) -> str:
    """The export's weights and activations in a few words, from its manifest."""
    manifest = read_manifest(export)
    if manifest.quantization is None:
        return f"{manifest.dtype} weights"
    sources = ", ".join(f"{n} {kind}" for kind, n in manifest.quantization.sources().items())
    return f"{sources}; {manifest.quantization.activations} activations"


def scored(model, ids: list[int], window: int) -> tuple[float, int, int]:
    """(sum of negative log-probabilities, tokens scored, windows) of `ids` through `model`'s graphs."""
    import torch

    from paradecode.runtime.decoding import MAIN, DecodeContext
    from paradecode.runtime.row_exactness import AS_IS
    from paradecode.runtime.tracing import Timeline

    backend = model.backend
    if not backend.manifest.with_logits:
        raise UserInputError(
            f"{backend.export.path} was exported with --no-logits: its final head gives no logits to score with."
        )
    cache = backend.allocate_cache(1)
    ctx = DecodeContext(backend, cache, Timeline(record_spans=False), form=AS_IS)
    total, count, windows = 0.0, 0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        cache.reset()
        with ctx.prompt():
            hidden = ctx.layers(MAIN, 1, ctx.num_layers, ctx.embed(MAIN, chunk, 0), 0)
            logits = ctx.head(MAIN, "final", hidden, 0, logits=True).logits.to(torch.float64)
        targets = torch.tensor(chunk[1:])
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        total -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(chunk) - 1
        windows += 1
    return total, count, windows


def measure(exports: list[Path], text: str, tokens: int, window: int) -> list[Perplexity]:
    from paradecode.runtime import load

    results, ids, vocab = [], None, None
    for export in exports:
        started = time.perf_counter()
        with load(export) as model:
            if ids is None:
                if model.tokenizer is None:
                    raise UserInputError(f"{export} has no tokenizer to read the text with.")
                ids, vocab = model.tokenizer.encode(text)[:tokens], model.manifest.spec.vocab_size
                if len(ids) < 2:
                    raise UserInputError(f"the text is {len(ids)} token(s) long: nothing to score.")
            elif model.manifest.spec.vocab_size != vocab:
                raise UserInputError(
                    f"{export} has a vocabulary of {model.manifest.spec.vocab_size} tokens, {exports[0]} one of "
                    f"{vocab}: perplexities compare exports of one model."
                )
            limit = min(window, model.capacity)
            total, count, windows = scored(model, ids, limit)
        seconds = time.perf_counter() - started
        results.append(Perplexity(str(export), format_of(export), count, windows, math.exp(total / count), seconds))
        print(f"{export}: perplexity {results[-1].perplexity:.3f} over {count} tokens ({seconds:.0f} s)", flush=True)
    return results


def table(results: list[Perplexity]) -> str:
    first = results[0].perplexity
    lines = ["| export | format | tokens | perplexity | vs the first |", "| --- | --- | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r.export} | {r.format} | {r.tokens} | {r.perplexity:.3f} | {r.perplexity / first:.4f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paradecode-perplexity", description=__doc__.splitlines()[0])
    parser.add_argument("exports", type=Path, nargs="+", metavar="EXPORT", help="folders written by paradecode-export")
    parser.add_argument(
        "--text", default=DEFAULT_TEXT, help="a UTF-8 text file, or `eval` (default): the held-out prompt set's text"
    )
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, metavar="N", help="score the first N tokens")
    parser.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, metavar="W", help="tokens a window (at most an export's context)"
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for name in ("tokens", "window"):
        if getattr(args, name) < 2:
            parser.error(f"--{name} must be at least 2, got {getattr(args, name)}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    code, results = run_command(
        "paradecode-perplexity", lambda: measure(args.exports, text_of(args.text), args.tokens, args.window)
    )
    if code:
        return code
    if args.json:
        from paradecode.tools.reporting import save_json

        save_json(args.json, {"text": args.text, "window": args.window, "results": [asdict(r) for r in results]})
    print(table(results))
    print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
