"""Prompts the model writes itself (`--written N`): more of a draft head's data in its own words, on new topics.

A chat model asked to write a request answers it instead (SmolLM2-135M-Instruct does), so the model continues a
numbered list instead: four requests drawn (seeded) from the training prompts, as plain text, and the model's
sampled fifth line is a new request. Its greedy answer is then recorded as any prompt's (export/draft/data.py, in
the series `written-*`). Writing costs a line's generation (about 30 tokens) per prompt, answering one an answer's.

The prompts written are kept in the data folder (`written-prompts.json`) with what wrote them (the export, the
examples, the count and the seed): a later run reads them back instead of writing them again (a changed request
is refused, as a changed shard is), so the answers recorded from them stay valid.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from paradecode.export.draft.data import digest
from paradecode.graphs.errors import UserInputError

logger = logging.getLogger(__name__)

FILE = "written-prompts.json"
EXAMPLES = 4  # requests shown before the line the model writes
MAX_EXAMPLE_CHARS = 300  # longer requests (passages to summarise) make lists the model loses track of
TEMPERATURE = 0.9
MAX_TOKENS = 64  # a written request's line at most


def examples_of(prompts: list) -> list[str]:
    """The requests a list may show: single-turn chats' and text prompts' texts of one line, short enough."""
    texts = []
    for prompt in prompts:
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"] if len(prompt) == 1 else None
        if text and "\n" not in text.strip() and len(text) <= MAX_EXAMPLE_CHARS:
            texts.append(text.strip())
    return texts


def listing(examples: list[str], index: int, seed: int) -> str:
    """The text whose continuation is written prompt `index`: EXAMPLES of `examples` (seeded by `index`), numbered,
    and the next number."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    chosen = torch.randperm(len(examples), generator=generator)[:EXAMPLES].tolist()
    lines = "".join(f"{k + 1}. {examples[i]}\n" for k, i in enumerate(chosen))
    return f"Requests people sent to an AI assistant:\n\n{lines}{len(chosen) + 1}."


def write_prompts(model, examples: list[str], count: int, folder: Path, seed: int) -> list[str]:
    """`count` requests the model writes (the module docstring), read back from `folder` where a run with the same
    export, examples, count and seed wrote them. Empty lines are left out, so there may be fewer."""
    from paradecode.runtime.engine import generate_batched

    if len(examples) < EXAMPLES:
        raise UserInputError(
            f"--written needs at least {EXAMPLES} training prompts of one line and at most {MAX_EXAMPLE_CHARS} "
            f"characters to show the model; the prompts have {len(examples)}."
        )
    identity = {
        "export": model.manifest.model["weights_sha256"],
        "examples": digest(examples),
        "count": count,
        "seed": seed,
        "temperature": TEMPERATURE,
    }
    path = folder / FILE
    if path.exists():
        kept = json.loads(path.read_text(encoding="utf-8"))
        differs = sorted(k for k, v in identity.items() if kept.get("identity", {}).get(k) != v)
        if differs:
            raise UserInputError(
                f"{path} was written by another run (its {', '.join(differs)} differ from this one's): give another "
                f"--data folder, or delete {path} and the written-* shards to write them again."
            )
        return kept["prompts"]
    requests = [
        model.request(
            prompt=listing(examples, i, seed),
            max_new_tokens=MAX_TOKENS,
            temperature=TEMPERATURE,
            seed=seed * 1_000_003 + i,
            stop=["\n"],
            mode="ar",
        )
        for i in range(count)
    ]
    logger.info("writing %d prompts", count)
    written = [(r.shown_text or "").strip() for r in generate_batched(model.runtime, requests)]
    prompts = [text for text in written if text]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"identity": identity, "prompts": prompts}, indent=1), encoding="utf-8")
    tmp.replace(path)
    return prompts
