"""The exit heads' reduced vocabulary: the tokens the final layer predicts most often, as many as a budget allows.

A head over the whole vocabulary reads V x D unembedding weights per call: on SmolLM2-135M that is
about 8 of its decoder layers (docs/design.md §6), paid by every token at every exit layer it passes.
A head over N tokens costs N x D + D x D (its rows of the unembedding and its transform); the budget
says how many decoder layers' worth of parameters that may be, which fixes N. The tokens are the
final layer's top-1 predictions in the training part of the distillation data, ranked by frequency
(as FR-Spec and EAGLE-3's draft vocabulary do); where the budget has room for more tokens than the
final layer ever chose there, the rest are ranked by soft counts, the final layer's probability of
each token summed over those positions (its expected frequency). On SmolLM2 with 10,700 training
positions the final layer chose 1,550 distinct tokens, which held-out continuations of other prompts
used 90.0% of the time; filling the budget of 5,568 tokens by soft counts raised that to 95.5%.
"""

from __future__ import annotations

import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.spec import ModelSpec


def layer_parameters(spec: ModelSpec) -> int:
    """Weights one decoder layer reads per call: attention projections and the MLP (norms left out)."""
    d, ffn = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return d * (2 * q + 2 * kv) + (3 if spec.mlp == "gated" else 2) * d * ffn


def head_parameters(spec: ModelSpec, vocab: int) -> int:
    """Weights one exit head reads per call: its unembedding rows and its d x d transform."""
    return vocab * spec.hidden_size + spec.hidden_size**2


def vocab_budget(spec: ModelSpec, layers: float) -> int:
    """The most tokens a head may predict over while costing at most `layers` decoder layers' parameters."""
    d = spec.hidden_size
    size = min(spec.vocab_size, int((layers * layer_parameters(spec) - d * d) // d))
    if size < 2:
        raise UserInputError(
            f"--head-budget {layers:g} layers ({layers * layer_parameters(spec):,.0f} parameters) leaves room for "
            f"{max(size, 0)} tokens after the head's {d}x{d} transform; a head needs at least 2. Give a larger budget."
        )
    return size


def frequent_tokens(tokens: torch.Tensor, soft_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` tokens the final layer predicts most often, most frequent first: by how often they are its
    top-1 in `tokens` (int64 [N]), then by `soft_counts` ([V]), then by id."""
    counts = torch.bincount(tokens, minlength=len(soft_counts))
    order = torch.argsort(-soft_counts, stable=True)  # equal soft counts keep ascending ids
    order = order[torch.argsort(-counts[order], stable=True)]  # then top-1 counts first, soft counts breaking ties
    return order[:size].clone()
