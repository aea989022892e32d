"""What exit heads learn from: the model's own greedy continuations, recorded while they are generated.

Generation is batched (Hugging Face `generate`, left padding, prompts sorted by length so that a
batch pads little). Forward hooks record, for every generated token, at the position that
predicted it: the hidden state after each exit layer, the final normed hidden state, the final
layer's log-normaliser (logsumexp of its logits over the whole vocabulary) and its top-1 token.
That is all distillation needs (the teacher's probability of any token is its logit, from the
final normed state and the frozen unembedding, minus the log-normaliser), so the data never goes
through the model a second time, and memory grows with (exit layers + 1) x hidden size per
position, in float16, never with the vocabulary. The hooks also sum the final layer's
distribution over the training sequences' positions (the *soft counts* of every token, one
vocabulary-sized vector), which ranks the tokens the final layer never chose for the reduced
vocabulary. Held-out sequences are chosen before generation, so nothing about them reaches the
vocabulary or the training. `--text` windows go through the same hooks in one forward pass each,
keeping every position.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paradecode.graphs.errors import UnsupportedModelError
from paradecode.graphs.ops import softcap

logger = logging.getLogger(__name__)

STORE = torch.float16  # hidden states as stored; training and evaluation compute in float32

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
    """Per position (one per predicted token): what the exit heads see and what the final layer says."""

    exits: dict[int, torch.Tensor]  # layer -> [N, D] STORE: hidden state after that layer
    final: torch.Tensor  # [N, D] STORE: after the final norm
    lognorm: torch.Tensor  # [N] float32: logsumexp of the final logits over the whole vocabulary
    token: torch.Tensor  # [N] int64: the final layer's top-1 token
    sequence: torch.Tensor  # [N] int64: the sequence (prompt or text window) each position came from

    def __len__(self) -> int:
        return len(self.token)

    @classmethod
    def cat(cls, parts: list[Features]) -> Features:
        return cls(
            {e: torch.cat([p.exits[e] for p in parts]) for e in parts[0].exits},
            torch.cat([p.final for p in parts]),
            torch.cat([p.lognorm for p in parts]),
            torch.cat([p.token for p in parts]),
            torch.cat([p.sequence for p in parts]),
        )

    def select(self, rows: torch.Tensor) -> Features:
        return Features(
            {e: h[rows] for e, h in self.exits.items()},
            self.final[rows],
            self.lognorm[rows],
            self.token[rows],
            self.sequence[rows],
        )

    def nbytes(self) -> int:
        tensors = [*self.exits.values(), self.final, self.lognorm, self.token, self.sequence]
        return sum(t.numel() * t.element_size() for t in tensors)


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The model's decoder layers: the first module list of `num_layers` entries (`model.layers`, `transformer.h`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise UnsupportedModelError(
        f"{type(model).__name__} has no list of {num_layers} decoder layers to record hidden states from."
    )


class Recorder:
    """Forward hooks on the exit layers, the final norm and the LM head.

    Per forward call it keeps the last position of each row (`last_only`, for generation: the
    position that predicts the next token) or every position, as float16 hidden states and the
    final logits' logsumexp and argmax. It also adds the final layer's distribution at every kept
    position of a row whose `weight` (set per batch) is 1 to `soft_counts`; in generation a row's
    weight drops to 0 after its first EOS (`eos`), where the row is padding. `on_call` runs after
    each LM head call.
    """

    def __init__(
        self,
        layers: torch.nn.ModuleList,
        final_norm: torch.nn.Module,
        lm_head: torch.nn.Module,
        exit_layers: tuple[int, ...],
        vocab_size: int,
        *,
        last_only: bool,
        eos: torch.Tensor | None = None,
        on_call: Callable[[], None] | None = None,
        logit_softcap: float | None = None,
    ):
        self.modules = [(layers[e - 1], e) for e in exit_layers] + [(final_norm, "final"), (lm_head, "logits")]
        self.logit_softcap = logit_softcap  # the model caps its LM head's output: the distribution is of capped logits
        self.last_only, self.on_call = last_only, on_call
        self.eos = eos if eos is not None else torch.zeros(0, dtype=torch.int64)
        self.calls: dict[int | str, list[torch.Tensor]] = {key: [] for _, key in self.modules}
        self.calls["token"] = []
        self.soft_counts = torch.zeros(vocab_size, dtype=torch.float64)
        self.weight: torch.Tensor | None = None  # [B] per row of the current batch; None: every row counts
        self.handles: list = []

    def __enter__(self) -> Recorder:
        for module, key in self.modules:
            self.handles.append(module.register_forward_hook(self.hook(key)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def hook(self, key: int | str):
        def record(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            out = out[:, -1:] if self.last_only else out
            if key == "logits":
                self.logits(out.detach().float())
            else:
                self.calls[key].append(out.detach().to(STORE))  # [B, T, D]

        return record

    def logits(self, logits: torch.Tensor) -> None:
        if self.logit_softcap is not None:
            logits = softcap(logits, self.logit_softcap)
        token = logits.argmax(-1)  # [B, T]
        self.calls["logits"].append(torch.logsumexp(logits, dim=-1))
        self.calls["token"].append(token)
        probs = torch.softmax(logits, dim=-1)
        if self.weight is None:
            self.soft_counts += probs.sum((0, 1)).double()
        else:
            self.soft_counts += (probs * self.weight[:, None, None]).sum((0, 1)).double()
            self.weight = self.weight * ~torch.isin(token[:, -1], self.eos)
        if self.on_call is not None:
            self.on_call()

    def take(self) -> dict[int | str, torch.Tensor]:
        """What was recorded, concatenated along positions ([B, calls x T, ...]); the recorder starts afresh."""
        taken = {key: torch.cat(values, dim=1) for key, values in self.calls.items()}
        for values in self.calls.values():
            values.clear()
        return taken


def recorder_for(model, family, spec, exit_layers: tuple[int, ...], **kwargs) -> Recorder:
    layers = decoder_layers(model, spec.num_layers)
    return Recorder(
        layers,
        family.final_norm(model),
        family.lm_head(model),
        exit_layers,
        spec.vocab_size,
        logit_softcap=spec.final_logit_softcap,
        **kwargs,
    )


@dataclass
class Recording:
    """The features of every position, which are held out, the training positions' soft counts, the sequences."""

    features: Features
    held_out: torch.Tensor  # [N] bool: the position belongs to a held-out sequence
    soft_counts: torch.Tensor  # [V] float64: the final layer's probabilities summed over the training positions
    sequences: list[list[int]]  # each prompt with its continuation (or each text window)


def stop_tokens(model) -> tuple[tuple[int, ...], int]:
    """The token ids greedy generation stops at (the model's generation config, else its config) and the id
    finished rows are padded with (its pad token, else its first EOS, else 0)."""
    config = model.generation_config
    eos = config.eos_token_id if config.eos_token_id is not None else model.config.eos_token_id
    eos = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    pad = config.pad_token_id
    return eos, int(pad) if isinstance(pad, int) else (eos[0] if eos else 0)


def batches_by_length(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Indices of `prompts` in batches of similar length (longest first, so the peak memory comes first)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def generate_features(
    model,
    family,
    spec,
    prompts: list[list[int]],
    exit_layers: tuple[int, ...],
    held_out: torch.Tensor,
    *,
    new_tokens: int,
    batch: int,
    progress: Callable[[int], None] | None = None,
) -> Recording:
    """Greedy continuations of `prompts` (batched, left-padded) and the features of every generated token.

    `held_out`: [len(prompts)] bool, the prompts whose continuations are held out. A row ends at the
    model's EOS (its generation config's); a token after it is not generated (the row is padding from
    there) and has no features. `progress(n)` is told of every generation step (n steps at a time).
    """
    from transformers import GenerationConfig

    eos_token_ids, pad_token_id = stop_tokens(model)
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        eos_token_id=list(eos_token_ids) or None,
    )
    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
    parts: list[Features] = []
    sequences: list[list[int]] = [[] for _ in prompts]
    disagree = 0
    steps = [0]

    def step() -> None:
        steps[0] += 1
        if progress is not None:
            progress(1)

    with recorder_for(model, family, spec, exit_layers, last_only=True, eos=eos, on_call=step) as recorder:
        for rows in batches_by_length(prompts, batch):
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
            mask = torch.zeros((len(rows), width), dtype=torch.int64)
            for r, i in enumerate(rows):
                ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]) :] = 1
            steps[0] = 0
            recorder.weight = (~held_out[rows]).float()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            if progress is not None:
                progress(new_tokens - steps[0])  # the steps left when every row ended early
            generated = out[:, width:]
            taken = recorder.take()
            count = generated.shape[1]
            if taken["token"].shape[1] != count:
                raise RuntimeError(
                    f"recorded {taken['token'].shape[1]} forward calls for {count} generated tokens: generate() "
                    "did not call the model once per token"
                )
            is_eos = torch.isin(generated, eos).int()
            valid = (is_eos.cumsum(1) - is_eos) == 0  # no EOS before this step
            disagree += int(((taken["token"] != generated) & valid).sum())
            owner = torch.tensor(rows).unsqueeze(1).expand(-1, count)
            parts.append(
                Features(
                    {e: taken[e][valid] for e in exit_layers},
                    taken["final"][valid],
                    taken["logits"][valid],
                    taken["token"][valid],
                    owner[valid],
                )
            )
            for r, i in enumerate(rows):
                sequences[i] = list(prompts[i]) + generated[r, : int(valid[r].sum())].tolist()
    if disagree:
        logger.warning(
            "%d generated tokens differ from the final layer's top-1 (the model's generation config adds logits "
            "processors); the heads learn the final layer's own choices",
            disagree,
        )
    features = Features.cat(parts)
    features = features.select(torch.argsort(features.sequence, stable=True))  # grouped by prompt, in order
    return Recording(features, held_out[features.sequence], recorder.soft_counts, sequences)


def text_features(
    model, family, spec, windows: list[list[int]], exit_layers: tuple[int, ...], held_out: torch.Tensor, progress=None
) -> Recording:
    """Features of every position of every window of given text (one forward pass each)."""
    parts = []
    with recorder_for(model, family, spec, exit_layers, last_only=False) as recorder:
        for index, window in enumerate(windows):
            recorder.weight = (~held_out[index : index + 1]).float()
            with torch.no_grad():
                model(torch.tensor([window]), use_cache=False)
            taken = recorder.take()
            parts.append(
                Features(
                    {e: taken[e][0] for e in exit_layers},
                    taken["final"][0],
                    taken["logits"][0],
                    taken["token"][0],
                    torch.full((len(window),), index),
                )
            )
            if progress is not None:
                progress(1)
    features = Features.cat(parts)
    return Recording(features, held_out[features.sequence], recorder.soft_counts, [list(w) for w in windows])


def held_out_sequences(count: int, fraction: float, seed: int) -> torch.Tensor:
    """[count] bool: about `fraction` of the sequences, chosen at random, held out (at least one, and at least
    one left to train on when there are two or more)."""
    held = max(1, min(count - 1, math.ceil(count * fraction))) if count > 1 else count
    chosen = torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:held]
    mask = torch.zeros(count, dtype=torch.bool)
    mask[chosen] = True
    return mask
