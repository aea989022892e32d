"""Exit heads by distillation, and threshold calibration (DESIGN.md §2).

A head after layer e computes logits = E · norm(T_e · h_e), with E the frozen unembedding and norm
the frozen final norm; only T_e (d x d, initialised to identity) is trained, to minimise
KL(final-layer distribution || head distribution) on hidden states of text the model generates
itself (greedily, from prompts) or of given text. Whole sequences are held out to measure top-1
agreement with the final layer and to calibrate thresholds: per exit layer, the lowest threshold
at which early tokens agree with the final ones at least at the target rate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

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
MIN_SUPPORT = 20  # a threshold needs at least this many held-out positions at or above it


@dataclass
class Features:
    """Per position: hidden state after each exit layer, and the final layer's normed hidden state."""

    exits: dict[int, torch.Tensor]  # layer -> [N, D]
    final: torch.Tensor  # [N, D], after the final norm
    sequence: torch.Tensor  # [N] index of the sequence each position came from


@dataclass
class HeadsTraining:
    transforms: dict[int, torch.Tensor]
    agreement: dict[int, dict[str, float]]  # layer -> {"untrained": a, "trained": b} on held-out positions
    calibration: dict[str, Any]
    data: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


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


def unembedding(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model's final norm and LM head (frozen)."""
    body = model.base_model
    norm = body.norm if hasattr(body, "norm") else body.ln_f  # Llama-like families / GPT-2
    return norm, model.get_output_embeddings()


def head_logits(norm, lm_head, transform: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    if transform is not None:
        hidden = hidden @ transform.t()
    return lm_head(norm(hidden)).float()


def agreement(norm, lm_head, transform, hidden, final_tokens) -> float:
    with torch.no_grad():
        return float((head_logits(norm, lm_head, transform, hidden).argmax(-1) == final_tokens).float().mean())


def train_heads(
    model,
    features: Features,
    held_out: torch.Tensor,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int = 0,
    log_every: int = 50,
) -> tuple[dict[int, torch.Tensor], list[dict[str, Any]]]:
    """Train T_e per exit layer by KL to the final distribution; return transforms and the progress history."""
    norm, lm_head = unembedding(model)
    for p in model.parameters():
        p.requires_grad_(False)
    train_rows = torch.nonzero(~held_out).squeeze(1)
    test_rows = torch.nonzero(held_out).squeeze(1)
    with torch.no_grad():
        final_tokens = lm_head(features.final[test_rows]).argmax(-1)
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
                    agreement(norm, lm_head, t.detach(), features.exits[e][test_rows], final_tokens), 4
                )
            if history and "loss" in history[-1]:
                entry["loss"] = history[-1]["loss"]
            history.append(entry)
            logger.info("  step %d/%d: %s", step, steps, "  ".join(f"{k} {v}" for k, v in entry.items() if k != "step"))
        if step == steps:
            break
        rows = train_rows[torch.randint(0, len(train_rows), (min(batch, len(train_rows)),), generator=generator)]
        with torch.no_grad():
            teacher = F.log_softmax(lm_head(features.final[rows]).float(), dim=-1)
        loss = 0.0
        for e, t in transforms.items():
            student = F.log_softmax(head_logits(norm, lm_head, t, features.exits[e][rows]), dim=-1)
            loss = loss + F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({"loss": round(float(loss.detach()) / len(transforms), 5)})
    history = [h for h in history if "step" in h]
    return {e: t.detach().clone() for e, t in transforms.items()}, history


@dataclass(frozen=True)
class CostModel:
    """Decode cost per token in units of one decoder layer, for choosing which exit layers to use.

    `head`: one exit (or final) head, relative to a layer: about vocab * d / (layer parameters) when
    reading weights dominates, never below `min_head` (a call has a fixed cost). `merge`: what a
    pending position adds to a later token's batched call. `rollback`: work lost per rejected early
    token.
    """

    num_layers: int
    head: float
    merge: float = 0.1
    rollback: float | None = None  # default: num_layers (about one token's worth of work)
    min_head: float = 0.25

    @classmethod
    def estimate(cls, spec) -> CostModel:
        d, ffn = spec.hidden_size, spec.intermediate_size
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        layer = d * (2 * q + 2 * kv) + (3 if spec.mlp == "gated" else 2) * d * ffn
        return cls(spec.num_layers, max(cls.min_head, (spec.vocab_size * d + d * d) / layer))

    def ar(self) -> float:
        return self.num_layers + self.head

    def paradecode(self, layers: tuple[int, ...], confidence, agree, thresholds) -> float:
        """Expected cost per token when tokens exit at the first of `layers` whose threshold they reach."""
        rollback = self.rollback if self.rollback is not None else self.num_layers
        remaining = torch.ones_like(next(iter(confidence.values())), dtype=torch.bool)
        cost, heads = 0.0, 0
        for e in layers:
            heads += 1
            exits = remaining & (confidence[e] >= thresholds[e])
            rate = float(exits.float().mean())
            wrong = float((~agree[e][exits]).float().mean()) if exits.any() else 0.0
            cost += rate * (e + heads * self.head + self.merge * (self.num_layers - e) + wrong * rollback)
            remaining &= ~exits
        return cost + float(remaining.float().mean()) * (self.num_layers + (heads + 1) * self.head)


def calibrate(
    confidence: dict[int, torch.Tensor], agree: dict[int, torch.Tensor], target: float, cost: CostModel | None = None
) -> dict[str, Any]:
    """Per exit layer, the lowest threshold whose early tokens agree with the final ones at rate >= target;
    then, with a cost model, the subset of exit layers to use.

    `confidence[e]` is the head's top-1 probability and `agree[e]` whether its top-1 equals the final
    top-1, over the same held-out positions. A layer whose agreement never reaches the target on at
    least MIN_SUPPORT positions gets no threshold. Every head a token passes costs a head call, so
    using every calibrated layer is rarely best: each subset's expected speedup over plain decoding
    is estimated and the best one is selected (its layers keep their thresholds; the others get
    none, so their heads never run). Reports per layer the share of positions at or above its
    threshold, and, for the selection, the share exiting there first in the cascade the runtime runs.
    """
    calibrated: dict[int, float] = {}
    layers: dict[str, dict[str, Any]] = {}
    for e in sorted(confidence):
        order = torch.argsort(confidence[e], descending=True)
        conf, hits = confidence[e][order], agree[e][order].float()
        precision = torch.cumsum(hits, 0) / torch.arange(1, len(hits) + 1)
        ok = torch.nonzero((precision >= target) & (torch.arange(1, len(hits) + 1) >= MIN_SUPPORT)).squeeze(1)
        if len(ok):
            cut = int(ok[-1])
            calibrated[e] = float(conf[cut])
            layers[str(e)] = {
                "threshold": round(float(conf[cut]), 6),
                "precision": round(float(precision[cut]), 4),
                "exit_rate": round((cut + 1) / len(conf), 4),
            }
        else:
            layers[str(e)] = {"threshold": None, "precision": None, "exit_rate": 0.0}
    candidates = sorted(calibrated)
    subsets = [tuple(c for i, c in enumerate(candidates) if mask >> i & 1) for mask in range(1, 1 << len(candidates))]
    estimates = []
    if cost is not None:
        for subset in subsets:
            estimates.append(
                {
                    "layers": list(subset),
                    "speedup": round(cost.ar() / cost.paradecode(subset, confidence, agree, calibrated), 4),
                }
            )
        estimates.sort(key=lambda x: -x["speedup"])
        chosen = tuple(estimates[0]["layers"]) if estimates and estimates[0]["speedup"] > 1.0 else ()
    else:
        chosen = tuple(candidates)
    remaining = torch.ones_like(next(iter(confidence.values())), dtype=torch.bool)
    for e in sorted(confidence):
        layers[str(e)]["selected"] = e in chosen
        exits = remaining & (confidence[e] >= calibrated[e]) if e in chosen else torch.zeros_like(remaining)
        layers[str(e)]["cascade_exit_rate"] = round(float(exits.float().mean()), 4)
        layers[str(e)]["cascade_precision"] = round(float(agree[e][exits].float().mean()), 4) if exits.any() else None
        remaining &= ~exits
    return {
        "target_agreement": target,
        "thresholds": {str(e): (calibrated[e] if e in chosen else None) for e in sorted(confidence)},
        "selected_layers": list(chosen),
        "expected_speedup": estimates[0]["speedup"] if estimates and chosen else None,
        "cost_model": None
        if cost is None
        else {
            "head": round(cost.head, 4),
            "merge": cost.merge,
            "rollback": cost.rollback if cost.rollback is not None else cost.num_layers,
        },
        "subsets": estimates[:8],
        "layers": layers,
        "positions": len(next(iter(confidence.values()))),
    }


def evaluate_heads(
    model, features: Features, held_out: torch.Tensor, transforms: dict[int, torch.Tensor | None]
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Top-1 probability of each head and whether its top-1 agrees with the final layer, on held-out positions."""
    norm, lm_head = unembedding(model)
    rows = torch.nonzero(held_out).squeeze(1)
    confidence, agree = {}, {}
    with torch.no_grad():
        final_tokens = lm_head(features.final[rows]).argmax(-1)
        for e, t in transforms.items():
            probs = F.softmax(head_logits(norm, lm_head, t, features.exits[e][rows]), dim=-1)
            top = probs.max(-1)
            confidence[e], agree[e] = top.values, top.indices == final_tokens
    return confidence, agree


def split_held_out(features: Features, fraction: float, seed: int) -> torch.Tensor:
    """A mask of held-out positions: whole sequences, about `fraction` of them (at least one)."""
    sequences = int(features.sequence.max()) + 1
    count = max(1, min(sequences - 1, math.ceil(sequences * fraction))) if sequences > 1 else 1
    chosen = torch.randperm(sequences, generator=torch.Generator().manual_seed(seed))[:count]
    return torch.isin(features.sequence, chosen)
