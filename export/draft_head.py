"""The draft-head file: a draft head's own weights, its reduced vocabulary and the model it was made for.

A draft head (graphs/modules.py `DraftGraph`, docs/design.md) guesses the next tokens one after another from the last
layer's output and the embedding of the token just chosen; ParaDecode verifies its guesses as it verifies lookup's.
Its file is a safetensors file with

    draft.fuse.weight    [D, 2D]   the fusion of [last layer's output, next token's embedding]
    draft.layer.*                  one decoder layer, its tensors named and shaped as a layer's (`layers.{i}.*`)
    draft.vocab          [N] int64 the token ids it predicts over (distinct, within the model's vocabulary)
    draft.reduce.weight  [D, 3D]   only in a head that reads three layers' outputs (EAGLE-3's fusion,
                                   paradecode-train-draft --features): the map of [a low layer's output, a middle
                                   one's, the last one's] to the one its first guess at each position reads

and a JSON metadata entry naming the model it was made for (its weights' sha256), how it was made and, for a head
with `draft.reduce.weight`, its `feature_layers` (the low and middle layers, 1-based; `feature_layers(L)` where the
entry is absent). The export
(`paradecode-export --draft-head FILE`) adds `draft.unembed`, the vocabulary's rows of the model's unembedding as the
graphs compute with them, and refuses a head made for another model or of other shapes, saying which.

Worked example: a head for stories260K (D 64, 5 layers), untrained, over the first 32 token ids (what
`make_untrained_draft_head` does for any model, reading its spec and identity; the tests' `save_untrained_draft_head`):

    tensors = untrained_draft_head(spec, range(32), seed=0)     # draft.fuse.weight [64, 128], draft.layer.attn.q...
    save_draft_head(path, tensors, {"base_weights_sha256": ..., "trained": False})
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from paradecode.export.heads.file import check_made_for, read_tagged
from paradecode.graphs.errors import UserInputError
from paradecode.graphs.modules import LayerGraph
from paradecode.graphs.spec import ModelSpec

FORMAT = "paradecode-draft/1"
FUSE = "draft.fuse.weight"
LAYER = "draft.layer."
VOCAB = "draft.vocab"
REDUCE = "draft.reduce.weight"  # EAGLE-3's map of a low, a middle and the last layer's outputs to one [D, 3D]
UNEMBED = "draft.unembed"  # added by the export, never stored in the file
HOW_TO_MAKE = "Make one for this model with paradecode.export.draft_head.make_untrained_draft_head (untrained)."


def feature_layers(num_layers: int) -> tuple[int, int]:
    """The low and middle layers (1-based) whose outputs a draft head reading three layers takes beside the last
    one's: EAGLE-3 fuses the 2nd, the middle and a late layer's (SmolLM2's 30 layers: 2 and 15; stories260K's 5: 1
    and 2; one layer: 1 twice)."""
    low = max(1, min(2, num_layers // 3))
    return low, max(low, min(num_layers - 1, num_layers // 2))


def expected_shapes(spec: ModelSpec, *, features: bool = False) -> dict[str, tuple[int, ...]]:
    """Each float tensor of a draft head for a model of `spec` (`features`: one reading three layers), with its
    shape."""
    layer = LayerGraph(spec, spec.num_layers)
    shapes = {FUSE: (spec.hidden_size, 2 * spec.hidden_size)}
    for name, parameter in layer.named_parameters():
        shapes[LAYER + name] = tuple(parameter.shape)
    if features:
        shapes[REDUCE] = (spec.hidden_size, 3 * spec.hidden_size)
    return shapes


def untrained_draft_head(
    spec: ModelSpec, vocab: Iterable[int], *, seed: int = 0, features: bool = False
) -> dict[str, torch.Tensor]:
    """A draft head for a model of `spec` over the token ids `vocab`, with freshly initialised weights (as torch
    initialises a layer's): what the machinery is tested with, and what training starts from. `features`: one that
    reads three layers' outputs, its map initialised at random too (training starts it as the last layer's alone)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = LayerGraph(spec, spec.num_layers)
        fuse = torch.nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=False)
        reduce = torch.nn.Linear(3 * spec.hidden_size, spec.hidden_size, bias=False) if features else None
    tensors = {FUSE: fuse.weight.detach().clone()}
    tensors.update({LAYER + name: p.detach().clone() for name, p in layer.named_parameters()})
    if reduce is not None:
        tensors[REDUCE] = reduce.weight.detach().clone()
    tensors[VOCAB] = torch.tensor(list(vocab), dtype=torch.int64)
    return tensors


def head_feature_layers(tensors: dict[str, torch.Tensor], metadata: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The low and middle layers a draft head reads beside the last one (its metadata's `feature_layers`, else the
    rule it was trained by), () for a head that reads the last layer's output alone."""
    if REDUCE not in tensors:
        return ()
    return tuple(metadata.get("feature_layers") or feature_layers(num_layers))


def make_untrained_draft_head(
    model: str, path: str | Path, vocab: Iterable[int] | None = None, *, seed: int = 0, features: bool = False
) -> Path:
    """Write an untrained draft head for `model` (a folder, hub id or GGUF file, as `paradecode-export` takes) over
    the token ids `vocab` (default: the whole vocabulary) to `path`; `features`: one reading three layers' outputs."""
    from paradecode.export.families import family_for
    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.source import resolve_model

    source = resolve_model(model)
    hf_model = load_hf_model(source)
    spec = family_for(source.config_dict().get("model_type")).spec(hf_model.config, hf_model)
    vocab = range(spec.vocab_size) if vocab is None else vocab
    tensors = untrained_draft_head(spec, vocab, seed=seed, features=features)
    identity = source.identity()
    metadata = {"base_model": model, "base_weights_sha256": identity["weights_sha256"], "trained": False}
    if features:
        metadata["feature_layers"] = list(feature_layers(spec.num_layers))
    return save_draft_head(path, tensors, metadata)


def save_draft_head(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
    """Write a draft head atomically (a temporary name renamed at the end): nothing half-written is left."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    stored = {
        k: t.detach().to(torch.int64 if k == VOCAB else torch.float32).contiguous() for k, t in sorted(tensors.items())
    }
    try:
        save_file(stored, str(tmp), metadata={"format": FORMAT, "metadata": json.dumps(metadata)})
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_draft_head(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata) of a draft-head file, its format checked; `check_draft_head` checks it fits a model."""
    return read_tagged(path, "--draft-head", "draft-head", FORMAT, HOW_TO_MAKE)


def check_draft_head(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any], *, spec: ModelSpec, model: dict[str, Any]
) -> None:
    """Refuse a draft head made for another model, or whose tensors do not fit `spec`: name what differs."""
    check_made_for(f"--draft-head {path} was made", metadata, model, HOW_TO_MAKE)
    expected = expected_shapes(spec, features=REDUCE in tensors)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - {VOCAB})
    if missing or unexpected:
        raise UserInputError(
            f"--draft-head {path} does not hold a draft head for this model's layers: missing {missing}, "
            f"unexpected {unexpected}."
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape or not tensors[name].is_floating_point():
            raise UserInputError(
                f"--draft-head {path}: {name} is {tensors[name].dtype} {list(tensors[name].shape)}, expected a float "
                f"tensor {list(shape)} (hidden size {spec.hidden_size}): it was made for a model of other shapes."
            )
    vocab = tensors.get(VOCAB)
    if vocab is None or vocab.dtype != torch.int64 or vocab.dim() != 1 or len(vocab) < 2:
        shown = "none" if vocab is None else f"{vocab.dtype} {list(vocab.shape)}"
        raise UserInputError(f"--draft-head {path}: {VOCAB} must be at least 2 int64 token ids, got {shown}.")
    if int(vocab.min()) < 0 or int(vocab.max()) >= spec.vocab_size:
        raise UserInputError(
            f"--draft-head {path}: {VOCAB} holds token ids outside 0..{spec.vocab_size - 1} (from {int(vocab.min())} "
            f"to {int(vocab.max())}): it was made for another tokenizer."
        )
    if len(torch.unique(vocab)) != len(vocab):
        raise UserInputError(f"--draft-head {path}: {VOCAB} lists a token id more than once; each must be distinct.")
    layers = metadata.get("feature_layers")
    if (
        REDUCE in tensors
        and layers is not None
        and not (
            isinstance(layers, list)
            and len(layers) == 2
            and all(isinstance(x, int) and 1 <= x < spec.num_layers for x in layers)
        )
    ):
        raise UserInputError(
            f"--draft-head {path}: its metadata's feature_layers is {layers!r}; expected the two layers (1-based, "
            f"each in 1..{spec.num_layers - 1}) whose outputs it reads beside the last one's."
        )


def draft_weights(tensors: dict[str, torch.Tensor], unembed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The draft head's canonical weights in an export: its own, and its vocabulary's rows of `unembed` (the model's
    unembedding as its graphs compute with it)."""
    weights = {k: t.to(torch.float32).contiguous() for k, t in tensors.items() if k != VOCAB}
    weights[VOCAB] = tensors[VOCAB].contiguous()
    weights[UNEMBED] = unembed[tensors[VOCAB]].to(torch.float32).contiguous()
    return weights
