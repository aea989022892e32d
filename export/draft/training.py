"""Training a draft head on recorded data (export/draft/data.py), and the acceptance it reaches at each depth.

The head is the draft graph as the export computes it (graphs/modules.py `DraftGraph`: its fusion and decoder layer
trained, the model's final norm and its vocabulary's unembedding rows frozen), trained with its own guesses in the
loop: each step runs `chain_outputs` to `depth` guesses for every position of a batch of windows and moves each
depth's distribution over the draft's vocabulary toward the final head's there (cross-entropy against the final
head's softmax on the recorded output h[p], restricted to the vocabulary), so it learns to guess from its own
outputs as decoding makes it do.

Acceptance is measured as greedy decoding would see it: on the answers of held-out sequences, a chain starts at
every position v whose next token is the model's answer, and its depth-j guess is accepted if it and every guess
before it equal the final head's choices (`target`) there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paradecode.export.draft.chain import chain_outputs, depth_mask
from paradecode.export.draft.data import DraftData
from paradecode.export.draft_head import FUSE, LAYER, REDUCE, VOCAB, draft_weights
from paradecode.graphs.errors import UserInputError
from paradecode.graphs.modules import DraftGraph, EmbedGraph, build_subgraph
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import SubgraphIO

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingConfig:
    """How a draft head is trained: `steps` Adam steps on `batch` windows of up to `window` tokens each (passes over
    the windows, grouped by length: `batches`), guesses chained `depth` deep."""

    steps: int = 1000
    batch: int = 4
    window: int = 512  # most chat sequences whole (a window reads nothing of the one before it)
    depth: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0
    # EAGLE-1's feature loss: each depth's output is also pulled toward the last layer's output it stands for
    # (smooth L1), this many times the cross-entropy's weight (0: the cross-entropy alone)
    feature_weight: float = 0.0
    eval_every: int = 0  # steps between measures of held-out acceptance while training (0: at the end only)
    # EAGLE-3's fusion: the first guess reads a low, a middle and the last layer's outputs reduced to one (a linear map
    # learnt from [0, 0, I]: where training starts, the last layer's output alone) instead of the last layer's alone
    features: bool = False
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch", "window", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise UserInputError(f"--eval-every must be 0 (at the end only) or more steps, got {self.eval_every}.")
        for name in ("weight_decay", "feature_weight"):
            if not getattr(self, name) >= 0:
                raise UserInputError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}.")
        if self.window < 2:
            raise ValueError(f"window must be at least 2 tokens, got {self.window}")


@dataclass
class Acceptance:
    """Chains measured and how many reached each depth with every guess accepted."""

    chains: int
    accepted: list[int]  # accepted[j - 1]: chains whose guesses 1..j were all accepted

    @property
    def rates(self) -> list[float]:
        """The share of chains accepted to each depth."""
        return [a / self.chains if self.chains else 0.0 for a in self.accepted]

    @property
    def conditional(self) -> list[float]:
        """At each depth, the share of chains accepted to the depth before that this depth accepts too."""
        before = [self.chains, *self.accepted[:-1]]
        return [a / b if b else 0.0 for a, b in zip(self.accepted, before, strict=True)]

    @property
    def per_chain(self) -> float:
        """Guesses accepted per chain of the full depth (what one verification gains)."""
        return sum(self.accepted) / self.chains if self.chains else 0.0

    def to_dict(self) -> dict:
        return {"chains": self.chains, "accepted": self.accepted, "per_chain": round(self.per_chain, 4)}


@dataclass
class Draft:
    """A draft head being trained, with what it reads: the model's embedding, as the export computes it, and with
    `reduce` (TrainingConfig.features) the map of three layers' outputs to the one its first guess reads."""

    module: DraftGraph
    embed: EmbedGraph
    vocab: torch.Tensor  # [N] token ids
    reduce: torch.nn.Linear | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The draft-head file's tensors (export/draft_head.py)."""
        out = {FUSE: self.module.fuse.weight.detach().clone(), VOCAB: self.vocab.clone()}
        out |= {LAYER + n: p.detach().clone() for n, p in self.module.layer.named_parameters()}
        if self.reduce is not None:
            out[REDUCE] = self.reduce.weight.detach().clone()
        return out

    def trainable(self) -> list[torch.nn.Parameter]:
        reduce = [] if self.reduce is None else [*self.reduce.parameters()]
        return [*self.module.fuse.parameters(), *self.module.layer.parameters(), *reduce]

    def first_input(self, batch: Batch) -> torch.Tensor:
        """What the first guess at each position reads at the position before: the last layer's output, or with
        `reduce` the map of [low, middle, last] layers' outputs there. [B, T, D]."""
        if self.reduce is None:
            return batch.hidden
        return self.reduce(torch.cat([batch.features.flatten(2), batch.hidden], dim=-1))


@dataclass
class Batch:
    """Windows of recorded data padded at their ends to the longest: the last layer's outputs `hidden` [B, T, D],
    the feature layers' `features` [B, T, 2, D] (None unless the draft reads them), the tokens' embeddings
    [B, T, D] (float32), and `valid` [B, T - 1]: the entries of positions 1..T-1 inside a window."""

    hidden: torch.Tensor
    features: torch.Tensor | None
    embedded: torch.Tensor
    valid: torch.Tensor


def draft_of(
    spec: ModelSpec, weights: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], *, features: bool = False
) -> Draft:
    """A draft head of `tensors` (a draft-head file's) over the model of `weights` (an export's canonical weights,
    dequantized), as its export would compute it; with `features`, reading three layers' outputs (a new `reduce`
    starting from the last layer's alone, unless `tensors` hold one)."""
    unembed = weights["unembed.weight"] if "unembed.weight" in weights else weights["embed.tokens.weight"]
    tensors = dict(tensors)
    reduce_weight = tensors.pop(REDUCE, None)
    weights = {**weights, **draft_weights(tensors, unembed)}
    module = build_subgraph(spec, SubgraphIO("draft", "draft", None, (), ()), weights)
    embed = build_subgraph(spec, SubgraphIO("embed", "embed", None, (), ()), weights)
    reduce = None
    if features or reduce_weight is not None:
        d = spec.hidden_size
        reduce = torch.nn.Linear(3 * d, d, bias=False)
        with torch.no_grad():
            if reduce_weight is None:
                reduce.weight.zero_()
                reduce.weight[:, 2 * d :] = torch.eye(d)
            else:
                reduce.weight.copy_(reduce_weight)
    draft = Draft(module, embed, tensors[VOCAB], reduce)
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    for parameter in draft.trainable():
        parameter.requires_grad_(True)
    return draft


def windows(data: DraftData, length: int) -> list[tuple[int, int]]:
    """(start, end) of the windows training draws from: each sequence cut into pieces of at most `length` tokens
    (a later piece starts where the one before ended, so it reads none of it: what decoding's long sequences lose)."""
    out = []
    for s in range(data.sequences):
        start, end = int(data.starts[s]), int(data.starts[s + 1])
        out += [(a, min(a + length, end)) for a in range(start, end - 1, length) if min(a + length, end) - a >= 2]
    return out


BUCKET = 16  # batches whose windows are drawn together and grouped by length (`batches`)


def batches(spans: list[tuple[int, int]], size: int, generator: torch.Generator) -> Iterator[list[tuple[int, int]]]:
    """Batches of `size` windows, without end: each pass over `spans` in a seeded order, every BUCKET batches' windows
    sorted by length and cut into batches in that order, the batches then shuffled. A batch is padded to its longest
    window: drawn at random, SmolLM2's answers' windows filled 70% of a batch, grouped by length 96%."""
    while True:
        order = torch.randperm(len(spans), generator=generator).tolist()
        for first in range(0, len(order), size * BUCKET):
            group = sorted(order[first : first + size * BUCKET], key=lambda i: spans[i][1] - spans[i][0])
            cut = [group[i : i + size] for i in range(0, len(group), size)]
            for j in torch.randperm(len(cut), generator=generator).tolist():
                yield [spans[i] for i in cut[j]]


def batch_of(draft: Draft, data: DraftData, spans: list[tuple[int, int]]) -> Batch:
    """The windows `spans` of `data`, as `draft` reads them."""
    tokens = max(end - start for start, end in spans)
    dim = data.hidden.shape[1]
    hidden = torch.zeros(len(spans), tokens, dim)
    features = torch.zeros(len(spans), tokens, *data.features.shape[1:]) if draft.reduce is not None else None
    ids = torch.zeros(len(spans), tokens, dtype=torch.int64)
    valid = torch.zeros(len(spans), tokens - 1, dtype=torch.bool)
    positions = torch.zeros(len(spans), tokens, dtype=torch.int64)
    for i, (start, end) in enumerate(spans):
        first = int(data.starts[torch.searchsorted(data.starts, start, right=True) - 1])
        positions[i, : end - start] = torch.arange(start - first, end - first)
        hidden[i, : end - start] = data.hidden[start:end].to(torch.float32)
        if features is not None:
            features[i, : end - start] = data.features[start:end].to(torch.float32)
        ids[i, : end - start] = data.tokens[start:end]
        valid[i, : end - start - 1] = True
    with torch.no_grad():  # at each token's position in its sequence (learned positions read it)
        embedded = draft.embed(ids, positions)
    return Batch(hidden, features, embedded, valid)


def chain_loss(draft: Draft, batch: Batch, depth: int, feature_weight: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """The mean over depths of each depth's cross-entropy against the final head's distribution over the draft's
    vocabulary (positions a chain of that depth reaches, in the windows), plus `feature_weight` times the smooth L1
    distance of its output o_k[p] to h[p] there; and each depth's top-1 agreement there."""
    head, hidden, valid = draft.module.head, batch.hidden, batch.valid
    target = hidden[:, 1:]  # h[p] for the entries of positions 1..T-1, which o_k[p] stands for
    with torch.no_grad():
        teacher = torch.softmax(head.logits(target).to(torch.float32), dim=-1)
        best = teacher.argmax(-1)
    losses, agreement = [], []
    for k, output in enumerate(chain_outputs(draft.module, draft.first_input(batch), batch.embedded, depth), 1):
        mask = valid & depth_mask(hidden.shape[1], k)[None]
        logprobs = torch.log_softmax(head.logits(output).to(torch.float32), dim=-1)
        loss = -(teacher * logprobs).sum(-1)[mask].mean()
        if feature_weight:
            loss = loss + feature_weight * F.smooth_l1_loss(output[mask].to(torch.float32), target[mask])
        losses.append(loss)
        agreement.append(float((logprobs.argmax(-1) == best)[mask].float().mean()))
    return torch.stack(losses).mean(), agreement


def train(
    draft: Draft,
    data: DraftData,
    config: TrainingConfig,
    progress: Callable[[int, float, list[float]], None] | None = None,
    evaluate: Callable[[], Acceptance] | None = None,
) -> list[dict]:
    """Train `draft` in place on `data`'s windows; `progress(step, loss, agreement per depth)` every step. The
    history: loss and agreement every 10 steps, and `evaluate()`'s acceptance (held-out, in eval mode) after every
    `config.eval_every` steps."""
    spans = windows(data, config.window)
    if not spans:
        raise ValueError("the data has no sequence of 2 tokens or more to train on")
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(draft.trainable(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, config.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))
        ),
    )
    draft.module.train()
    history = []
    started = time.perf_counter()
    drawn = batches(spans, config.batch, generator)
    for step in range(config.steps):
        batch = batch_of(draft, data, next(drawn))
        loss, agreement = chain_loss(draft, batch, config.depth, config.feature_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.trainable(), 1.0)
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress(step, float(loss.detach()), agreement)
        if step % 10 == 0 or step == config.steps - 1:
            history.append(
                {
                    "step": step,
                    "loss": round(float(loss.detach()), 4),
                    "agreement": [round(a, 4) for a in agreement],
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
        done = step + 1
        if evaluate is not None and config.eval_every and done % config.eval_every == 0 and done < config.steps:
            draft.module.eval()
            measured = evaluate()
            draft.module.train()
            history.append({"step": step, "held_out": measured.to_dict()})
            logger.info(
                "step %d: held-out guesses accepted per chain %.3f, by depth %s",
                done,
                measured.per_chain,
                [round(r, 3) for r in measured.rates],
            )
    draft.module.eval()
    return history


def acceptance(draft: Draft, data: DraftData, depth: int, window: int = 1024) -> Acceptance:
    """Greedy chains of up to `depth` guesses from every answer position of `data`'s sequences (the module docstring),
    each sequence read in windows of `window` tokens."""
    chains, accepted = 0, [0] * depth
    vocab = draft.vocab
    with torch.no_grad():
        for span in windows(data, window):
            batch = batch_of(draft, data, [span])
            start, end = span
            target, answer = data.target[start + 1 : end], data.answer[start + 1 : end]  # positions 1..T-1
            right = [
                vocab[draft.module.head.logits(o).argmax(-1)][0] == target
                for o in chain_outputs(draft.module, draft.first_input(batch), batch.embedded, depth)
            ]
            for v in answer.nonzero().flatten().tolist():  # the chain from position v + 1 of the window
                chains += 1
                for j in range(depth):
                    p = v + j
                    if p >= len(target) or not (answer[p] and right[j][p]):
                        break
                    accepted[j] += 1
    return Acceptance(chains, accepted)


@dataclass
class Coverage:
    """How much of the held-out answers' next tokens a vocabulary holds (a guess outside it is never right)."""

    positions: int
    covered: int

    @property
    def share(self) -> float:
        return self.covered / self.positions if self.positions else 0.0


def coverage(vocab: torch.Tensor, data: DraftData) -> Coverage:
    targets = data.target[data.answer]
    return Coverage(len(targets), int(torch.isin(targets, vocab).sum()))
