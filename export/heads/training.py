"""Distillation of exit heads over a reduced vocabulary (docs/design.md §2, §6).

A head after layer e computes logits = E_V · norm(T_e · h_e), with E_V the frozen LM head's rows
for the reduced vocabulary V (`vocab`; None: the whole vocabulary) and norm the frozen final norm,
both the model's own (its family names them); only T_e (d x d) is trained.

T_e starts from the least-squares map from h_e to the final hidden state (before the final norm's
scale and shift), the linear shortcut of Din et al. (2023, "Jump to Conclusions"): one d x d solve
per layer, seconds, where the distillation steps cost about a second each on a CPU. On SmolLM2 it
alone gave a held-out top-1 agreement of 0.36/0.41/0.75 after layers 8/16/24, where 120 steps from
identity gave 0.41/0.49/0.71, and 60 steps from it 0.42/0.48/0.78.

The teacher is the final layer's distribution p over the whole vocabulary: p_i = exp(z_i - log Z),
z_i = E_i · final (the final normed hidden state) and log Z the log-normaliser recorded during
generation, so p needs only the rows of V. The head's q is over V only (zero elsewhere), so
KL(p || q) is infinite whenever p puts mass outside V; the loss is what remains of it on V, the
cross-entropy of the teacher's mass on V, - sum_{i in V} p_i log q_i. Reported (and minimised, the
same up to a constant) less its minimum, so that it reads as a divergence, 0 at best:

    loss = sum_{i in V} p_i log(p_i / (m q_i)) = m KL(p/m || q),   m = sum_{i in V} p_i

Unlike renormalising p over V, it weighs each position by the teacher's mass on V: positions whose
final token lies outside V (which the head can never get right, so whose exits are always
rejected) count for little, and the head spends its capacity where it can agree. Per position the
best q is still p renormalised over V, which keeps q's top-1 probability a confidence the
calibration can threshold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from paradecode.export.heads.data import Features
from paradecode.graphs.ops import softcap

if TYPE_CHECKING:
    from paradecode.export.families import Family

logger = logging.getLogger(__name__)

EVAL_CHUNK = 1024  # positions per evaluation step: bounds the [positions, vocab] logits held at once
PROGRESS_ROWS = 2048  # held-out positions the training progress measures agreement on


@dataclass(frozen=True)
class Unembedding:
    """The model's final norm and LM head, which every exit head reuses frozen, with what the norm multiplies by
    (`norm_scale`: its weight, Gemma's 1 + weight) and the cap of the model's logits (`softcap`, None: uncapped)."""

    norm: torch.nn.Module
    lm_head: torch.nn.Module
    norm_scale: torch.Tensor
    softcap: float | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, family: Family) -> Unembedding:
        spec = family.spec(model.config, model)
        return cls(
            family.final_norm(model), family.lm_head(model), family.final_norm_scale(model), spec.final_logit_softcap
        )

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits as the model gives them: soft-capped where it caps them (graphs.ops.softcap)."""
        return logits if self.softcap is None else softcap(logits, self.softcap)

    def freeze(self) -> None:
        for p in (*self.norm.parameters(), *self.lm_head.parameters()):
            p.requires_grad_(False)

    def rows(self, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight and bias for the tokens of `vocab` (all of them for None)."""
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        if vocab is None:
            return weight, bias
        return weight[vocab], None if bias is None else bias[vocab]

    def head_logits(
        self, hidden: torch.Tensor, transform: torch.Tensor | None = None, vocab: torch.Tensor | None = None
    ) -> torch.Tensor:
        """An exit head's logits over `vocab` for hidden states after its layer (no transform: the model's own)."""
        if transform is not None:
            hidden = hidden @ transform.t()
        return self.cap(F.linear(self.norm(hidden), *self.rows(vocab))).float()

    def final_logits(self, final: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The final head's logits over `vocab` for hidden states already through the final norm."""
        return self.cap(F.linear(final, *self.rows(vocab))).float()


def restricted_kl(student: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """sum_V p log(p / (m q)) per position, averaged: `student` log q over V [..., B, N], `teacher_logp` log p on
    V [B, N] (its mass m on V below 1). The cross-entropy of p's mass on V less its minimum (at q = p / m)."""
    p = teacher_logp.exp()
    mass = p.sum(-1, keepdim=True).clamp_min(1e-30)
    return (p * (teacher_logp - mass.log() - student)).sum(-1).mean(-1)


def teacher_log_probs(unembedding: Unembedding, features: Features, rows: torch.Tensor, vocab) -> torch.Tensor:
    """log p_i of the final layer's full-vocabulary distribution, for the tokens of `vocab` only: [rows, N]."""
    logits = unembedding.final_logits(features.final[rows].float(), vocab)
    return logits - features.lognorm[rows].unsqueeze(1)


def least_squares_init(
    unembedding: Unembedding, features: Features, rows: torch.Tensor, ridge: float = 1e-3
) -> dict[int, torch.Tensor]:
    """Per exit layer, T minimising sum ||T h_e - u||^2 over `rows` (ridge: `ridge` x the mean of diag(H^T H)),
    u the final normed hidden state with the norm's scale and shift undone; rescaled to the identity's norm
    (the norm makes T's scale irrelevant to the head, but Adam's steps are absolute)."""
    weight = unembedding.norm_scale.detach().float()
    bias = getattr(unembedding.norm, "bias", None)
    scale = torch.where(weight.abs() > 1e-6, weight, torch.ones_like(weight))
    target = features.final[rows].float() - (0.0 if bias is None else bias.detach().float())
    target = target / scale
    dim = len(weight)
    transforms = {}
    for e, hidden in features.exits.items():
        h = hidden[rows].float()
        gram = h.t() @ h
        gram += ridge * gram.diagonal().mean().clamp_min(1e-12) * torch.eye(dim)
        t = torch.linalg.solve(gram, h.t() @ target).t()
        transforms[e] = t * (dim**0.5 / t.norm().clamp_min(1e-12))
    return transforms


def train_heads(
    unembedding: Unembedding,
    features: Features,
    held_out: torch.Tensor,
    vocab: torch.Tensor | None,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int = 0,
    log_every: int = 50,
    init: dict[int, torch.Tensor] | None = None,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> tuple[dict[int, torch.Tensor], list[dict[str, Any]]]:
    """Train T_e for every exit layer at once; return the transforms and the progress history.

    Each step samples `batch` training positions; all exit layers' heads share one product with the
    unembedding rows. `init`: the transforms to start from (default: identity). Every `log_every`
    steps the history gets the mean loss since the last entry and the agreement with the final layer
    on (up to PROGRESS_ROWS) held-out positions. `progress` is called after every step with the
    step's loss. Freezes the unembedding's parameters (the model's own).
    """
    unembedding.freeze()
    layers = sorted(features.exits)
    train_rows = torch.nonzero(~held_out).squeeze(1)
    test_rows = torch.nonzero(held_out).squeeze(1)[:PROGRESS_ROWS]
    dim = features.final.shape[1]
    start = torch.stack([init[e] if init is not None else torch.eye(dim) for e in layers])
    transforms = torch.nn.Parameter(start.float().clone())  # [n, D, D]
    optimizer = torch.optim.Adam([transforms], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    weight, bias = unembedding.rows(vocab)
    history: list[dict[str, Any]] = []
    losses: list[float] = []
    for step in range(steps + 1):
        if step % log_every == 0 or step == steps:
            entry: dict[str, Any] = {"step": step}
            if losses:
                entry["loss"] = round(sum(losses) / len(losses), 5)
                losses.clear()
            current = {e: transforms[i].detach() for i, e in enumerate(layers)}
            _, agree = evaluate_heads(unembedding, features, test_rows, current, vocab)
            entry.update({f"agreement_{e}": round(float(agree[e].float().mean()), 4) for e in layers})
            history.append(entry)
            logger.debug("step %d/%d: %s", step, steps, entry)
        if step == steps:
            break
        rows = train_rows[torch.randint(0, len(train_rows), (min(batch, len(train_rows)),), generator=generator)]
        with torch.no_grad():
            teacher = teacher_log_probs(unembedding, features, rows, vocab)
        hidden = torch.stack([features.exits[e][rows] for e in layers]).float()  # [n, B, D]
        logits = unembedding.cap(
            F.linear(unembedding.norm(torch.bmm(hidden, transforms.transpose(1, 2))), weight, bias)
        )
        loss = restricted_kl(F.log_softmax(logits.float(), dim=-1), teacher).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress({"loss": losses[-1]})
    return {e: transforms[i].detach().clone() for i, e in enumerate(layers)}, history


def evaluate_heads(
    unembedding: Unembedding,
    features: Features,
    rows: torch.Tensor,
    transforms: dict[int, torch.Tensor | None],
    vocab: torch.Tensor | None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Each head's top-1 probability (over its vocabulary) and whether its top-1 is the final layer's, at `rows`."""
    confidence: dict[int, list[torch.Tensor]] = {e: [] for e in transforms}
    agree: dict[int, list[torch.Tensor]] = {e: [] for e in transforms}
    with torch.no_grad():
        for start in range(0, len(rows), EVAL_CHUNK):
            chunk = rows[start : start + EVAL_CHUNK]
            for e, t in transforms.items():
                top = F.softmax(unembedding.head_logits(features.exits[e][chunk].float(), t, vocab), dim=-1).max(-1)
                token = top.indices if vocab is None else vocab[top.indices]
                confidence[e].append(top.values)
                agree[e].append(token == features.token[chunk])
    empty = torch.zeros(0)
    return (
        {e: torch.cat(v) if v else empty for e, v in confidence.items()},
        {e: torch.cat(v) if v else empty.bool() for e, v in agree.items()},
    )
