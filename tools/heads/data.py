"""What exit heads learn from: the model's own greedy text, its hidden states, and a held-out split."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "def ",
    "import ",
    "class ",
    "from typing import",
    "def main():\n    ",
    "    return ",
    "if __name__ ==",
    "for i in range(",
    "# Copyright",
    "def __init__(self",
    "try:\n    ",
    "with open(",
    '"""',
    "x = [",
    "The ",
    "Once upon a time",
    "In the beginning",
    "It was a",
    "Question:",
    "Hello, my name is",
    "Here is a list of",
    "The following",
    "Chapter 1",
    "To install the package,",
)


@dataclass
class Features:
    """Per position: hidden state after each exit layer, and the final layer's normed hidden state."""

    exits: dict[int, torch.Tensor]  # layer -> [N, D]
    final: torch.Tensor  # [N, D], after the final norm
    sequence: torch.Tensor  # [N] index of the sequence each position came from


def greedy_sequences(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The model's own greedy continuation of each prompt (prompt included)."""
    sequences = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0,
            )
            sequences.append(out[0].tolist())
            if (i + 1) % max(1, len(prompts) // 4) == 0:
                logger.info("  generated %d/%d sequences", i + 1, len(prompts))
    return sequences


def collect(model, sequences: list[list[int]], exit_layers: tuple[int, ...]) -> Features:
    """Hidden states after each exit layer and after the final norm, for every position of every sequence."""
    exits: dict[int, list[torch.Tensor]] = {e: [] for e in exit_layers}
    finals, owners = [], []
    with torch.no_grad():
        for index, sequence in enumerate(sequences):
            out = model(torch.tensor([sequence]), output_hidden_states=True)
            states = out.hidden_states  # [embeddings, after layer 1, ..., after the final norm]
            for e in exit_layers:
                exits[e].append(states[e][0].float())
            finals.append(states[-1][0].float())
            owners.append(torch.full((len(sequence),), index))
    return Features({e: torch.cat(v) for e, v in exits.items()}, torch.cat(finals), torch.cat(owners))


def split_held_out(features: Features, fraction: float, seed: int) -> torch.Tensor:
    """A mask of held-out positions: whole sequences, about `fraction` of them (at least one)."""
    sequences = int(features.sequence.max()) + 1
    count = max(1, min(sequences - 1, math.ceil(sequences * fraction))) if sequences > 1 else 1
    chosen = torch.randperm(sequences, generator=torch.Generator().manual_seed(seed))[:count]
    return torch.isin(features.sequence, chosen)
