"""Distillation of exit heads (DESIGN.md §2).

A head after layer e computes logits = E · norm(T_e · h_e), with E the frozen LM head and norm the
frozen final norm, both the model's own (its family names them); only T_e (d x d, initialised to
identity) is trained, to minimise KL(final-layer distribution || head distribution) on hidden
states of text the model generates itself or of given text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from paradecode.tools.heads.data import Features

if TYPE_CHECKING:
    from paradecode.export.families import Family

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unembedding:
    """The model's final norm and LM head, which every exit head reuses frozen."""

    norm: torch.nn.Module
    lm_head: torch.nn.Module

    @classmethod
    def of(cls, model: torch.nn.Module, family: Family) -> Unembedding:
        return cls(family.final_norm(model), family.lm_head(model))

    def freeze(self) -> None:
        for p in (*self.norm.parameters(), *self.lm_head.parameters()):
            p.requires_grad_(False)

    def head_logits(self, hidden: torch.Tensor, transform: torch.Tensor | None = None) -> torch.Tensor:
        """An exit head's logits for hidden states after its layer (no transform: the model's own head)."""
        if transform is not None:
            hidden = hidden @ transform.t()
        return self.lm_head(self.norm(hidden)).float()

    def final_logits(self, final: torch.Tensor) -> torch.Tensor:
        """The final head's logits for hidden states already through the final norm."""
        return self.lm_head(final).float()


@dataclass
class HeadsTraining:
    """What a training run made: transforms per exit layer, agreement before and after, calibration, data."""

    transforms: dict[int, torch.Tensor]
    agreement: dict[int, dict[str, float]]  # layer -> {"untrained": a, "trained": b} on held-out positions
    calibration: dict[str, Any]
    data: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


def agreement(unembedding: Unembedding, transform, hidden, final_tokens) -> float:
    with torch.no_grad():
        return float((unembedding.head_logits(hidden, transform).argmax(-1) == final_tokens).float().mean())


def train_heads(
    unembedding: Unembedding,
    features: Features,
    held_out: torch.Tensor,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int = 0,
    log_every: int = 50,
) -> tuple[dict[int, torch.Tensor], list[dict[str, Any]]]:
    """Train T_e per exit layer by KL to the final distribution; return transforms and the progress history.

    Freezes the unembedding's parameters (they are the model's own and stay unchanged).
    """
    unembedding.freeze()
    train_rows = torch.nonzero(~held_out).squeeze(1)
    test_rows = torch.nonzero(held_out).squeeze(1)
    with torch.no_grad():
        final_tokens = unembedding.final_logits(features.final[test_rows]).argmax(-1)
    dim = features.final.shape[1]
    transforms = {e: torch.nn.Parameter(torch.eye(dim)) for e in features.exits}
    optimizer = torch.optim.Adam(transforms.values(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps + 1):
        if step % log_every == 0 or step == steps:
            entry = {"step": step}
            for e, t in transforms.items():
                entry[f"agreement_{e}"] = round(
                    agreement(unembedding, t.detach(), features.exits[e][test_rows], final_tokens), 4
                )
            if history and "loss" in history[-1]:
                entry["loss"] = history[-1]["loss"]
            history.append(entry)
            logger.info("  step %d/%d: %s", step, steps, "  ".join(f"{k} {v}" for k, v in entry.items() if k != "step"))
        if step == steps:
            break
        rows = train_rows[torch.randint(0, len(train_rows), (min(batch, len(train_rows)),), generator=generator)]
        with torch.no_grad():
            teacher = F.log_softmax(unembedding.final_logits(features.final[rows]), dim=-1)
        loss = 0.0
        for e, t in transforms.items():
            student = F.log_softmax(unembedding.head_logits(features.exits[e][rows], t), dim=-1)
            loss = loss + F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({"loss": round(float(loss.detach()) / len(transforms), 5)})
    history = [h for h in history if "step" in h]
    return {e: t.detach().clone() for e, t in transforms.items()}, history


def evaluate_heads(
    unembedding: Unembedding, features: Features, held_out: torch.Tensor, transforms: dict[int, torch.Tensor | None]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Top-1 probability of each head and whether its top-1 agrees with the final layer, on held-out positions."""
    rows = torch.nonzero(held_out).squeeze(1)
    confidence, agree = {}, {}
    with torch.no_grad():
        final_tokens = unembedding.final_logits(features.final[rows]).argmax(-1)
        for e, t in transforms.items():
            top = F.softmax(unembedding.head_logits(features.exits[e][rows], t), dim=-1).max(-1)
            confidence[e], agree[e] = top.values, top.indices == final_tokens
    return confidence, agree
