"""The trained exit-heads file: one d x d transform per exit layer, plus where it came from.

A heads file is a safetensors file with tensors ``exits.{e}.transform`` ([D, D], applied before the
final norm and the frozen unembedding), optionally ``exits.vocab`` (int64 [N]: the token ids of the
heads' reduced vocabulary; the export takes their rows of the unembedding), and a JSON metadata entry
naming the base model (its weights hash), the exit layers and how the heads were trained.
`paradecode-export --heads` refuses heads made for another model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.spec import ModelSpec

FORMAT = "paradecode-heads/1"
KEY = re.compile(r"^exits\.(\d+)\.transform$")
VOCAB = "exits.vocab"


def save_heads(
    path: str | Path,
    transforms: dict[int, torch.Tensor],
    metadata: dict[str, Any],
    vocab: torch.Tensor | None = None,
) -> Path:
    """Write heads atomically (a temporary name renamed at the end); `vocab`: a reduced vocabulary's token ids."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # as check_file_writable promised
    tmp = path.with_name(path.name + ".tmp")
    tensors = {f"exits.{e}.transform": t.detach().to(torch.float32).contiguous() for e, t in sorted(transforms.items())}
    if vocab is not None:
        tensors[VOCAB] = vocab.detach().to(torch.int64).contiguous()
    meta = dict(metadata, exit_layers=sorted(transforms))
    try:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "metadata": json.dumps(meta)})
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # nothing half-written is left beside `path`
    return path


def read_tagged(
    path: str | Path, flag: str, kind: str, fmt: str, how_to_make: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and JSON metadata of a paradecode safetensors file of format `fmt` (a heads file, a draft head's),
    given as `flag`; `kind` names it in messages, `how_to_make` says how to make one where there is none."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"{flag} {path}: no such file. {how_to_make}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (SafetensorError, OSError) as err:
        raise UserInputError(f"{flag} {path} is not a safetensors file ({err}).") from err
    if header.get("format") != fmt:
        raise UserInputError(
            f"{flag} {path} is not a paradecode {kind} file (format {header.get('format')!r}, expected {fmt!r})."
        )
    try:
        metadata = json.loads(header.get("metadata", "{}"))
    except json.JSONDecodeError as err:
        raise UserInputError(f"{flag} {path}: its metadata is not JSON ({err}).") from err
    if not isinstance(metadata, dict):
        raise UserInputError(f"{flag} {path}: its metadata is {type(metadata).__name__}, expected an object.")
    return tensors, metadata


def check_made_for(what: str, metadata: dict[str, Any], model: dict[str, Any], how_to_make: str) -> None:
    """Refuse a file (`what`: "--heads FILE was trained") whose metadata names another model's weights than `model`'s
    (an export's identity), saying how to make one for this model."""
    base = metadata.get("base_weights_sha256")
    if base != model["weights_sha256"]:
        raise UserInputError(
            f"{what} for another model ({metadata.get('base_model', 'unknown')}, weights sha256 {str(base)[:12]}...), "
            f"not for {model['source']} (weights sha256 {model['weights_sha256'][:12]}...). {how_to_make}"
        )


def load_heads(path: str | Path) -> tuple[dict[int, torch.Tensor], dict[str, Any], torch.Tensor | None]:
    """(transforms by exit layer, metadata, the reduced vocabulary's token ids or None)."""
    how = "Train heads with `paradecode-train-heads MODEL -o FILE`."
    tensors, metadata = read_tagged(path, "--heads", "heads", FORMAT, how)
    vocab = tensors.pop(VOCAB, None)
    if vocab is not None and (vocab.dtype != torch.int64 or vocab.dim() != 1 or len(vocab) < 2):
        raise UserInputError(
            f"--heads {path}: {VOCAB} must be a list of at least 2 int64 token ids, got {vocab.dtype} "
            f"{list(vocab.shape)}."
        )
    transforms = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if not match:
            raise UserInputError(f"--heads {path} has an unexpected tensor {key!r}.")
        transforms[int(match.group(1))] = tensor
    return transforms, metadata, vocab


def check_heads(
    path: Path,
    transforms: dict[int, torch.Tensor],
    metadata: dict[str, Any],
    *,
    spec: ModelSpec,
    model: dict[str, Any],
    exit_layers: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """Check heads against the model being exported; return the exit layers to export."""
    check_made_for(
        f"--heads {path} was trained", metadata, model, "Train heads for this model with `paradecode-train-heads`."
    )
    for layer, t in transforms.items():
        if tuple(t.shape) != (spec.hidden_size, spec.hidden_size):
            raise UserInputError(
                f"--heads {path}: the head after layer {layer} has shape {tuple(t.shape)}, "
                f"expected ({spec.hidden_size}, {spec.hidden_size})."
            )
    if exit_layers is None:
        return tuple(sorted(transforms))
    missing = [e for e in exit_layers if e not in transforms]
    if missing:
        raise UserInputError(
            f"--exit-layers asks for layers {missing}, but --heads {path} has heads for "
            f"layers {sorted(transforms)} only. Drop --exit-layers to use the file's layers."
        )
    return exit_layers
