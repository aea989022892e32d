"""The family registry and the helpers every family adapter shares."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from paradecode.graphs.errors import UnsupportedModelError
from paradecode.graphs.spec import ModelSpec

_FAMILIES: dict[str, Family] = {}
_BY_MODEL_TYPE: dict[str, Family] = {}

# Hugging Face `hidden_act` names -> the activations `graphs.ops.activation` implements.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


class Family:
    """Adapter from one Hugging Face architecture to the family-neutral subgraph contract."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    examples: ClassVar[str] = ""

    def spec(self, config: Any, model: torch.nn.Module) -> ModelSpec:
        """The family-neutral description of `model` (a loaded Hugging Face causal LM)."""
        raise NotImplementedError

    def weights(self, model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """The model's weights under the canonical names of `paradecode.graphs.modules`."""
        raise NotImplementedError

    def final_norm(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model's final norm, the module between the last decoder layer and the LM head."""
        raise NotImplementedError

    def final_norm_scale(self, model: torch.nn.Module) -> torch.Tensor:
        """What the final norm multiplies the normalised hidden state by (its weight; Gemma's 1 + weight)."""
        return self.final_norm(model).weight.detach()

    def lm_head(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model's LM head (the unembedding), which exit heads share with the final head."""
        head = model.get_output_embeddings()
        if head is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None); "
                "exit heads need a causal LM with an LM head (an ...ForCausalLM class)."
            )
        return head


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family available under its name and its Hugging Face model types."""
    family = cls()
    if cls.name in _FAMILIES:
        raise RuntimeError(f"family {cls.name!r} is registered twice")
    _FAMILIES[cls.name] = family
    for model_type in cls.model_types:
        _BY_MODEL_TYPE[model_type] = family
    return cls


def registered_families() -> dict[str, Family]:
    return dict(_FAMILIES)


def family_for(model_type: str | None) -> Family:
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        supported = ", ".join(f"{name} ({f.examples})" if f.examples else name for name, f in sorted(_FAMILIES.items()))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported. Supported families: {supported}. "
            "Adding one is a small module in export/families/."
        ) from None


def activation_of(hidden_act: str) -> str:
    try:
        return ACTIVATIONS[hidden_act]
    except KeyError:
        raise UnsupportedModelError(
            f"activation {hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}."
        ) from None


class WeightMapper:
    """Moves tensors from a Hugging Face state dict to canonical names, checking every shape.

    `finish()` fails if any source tensor was left unused (other than the ones named as ignored),
    so a weight the adapter does not understand can never be dropped silently.
    """

    def __init__(self, state: dict[str, torch.Tensor], what: str):
        self.state, self.what = state, what
        self.used: set[str] = set()
        self.out: dict[str, torch.Tensor] = {}

    def take(self, source: str, shape: tuple[int, ...], *, transpose: bool = False) -> torch.Tensor:
        if source not in self.state:
            raise UnsupportedModelError(f"{self.what}: weight {source!r} is missing from the checkpoint.")
        tensor = self.state[source]
        if transpose:
            tensor = tensor.t()
        if tuple(tensor.shape) != tuple(shape):
            raise UnsupportedModelError(
                f"{self.what}: weight {source!r} has shape {tuple(tensor.shape)}"
                f"{' after transposing' if transpose else ''}, expected {tuple(shape)}."
            )
        self.used.add(source)
        return tensor.contiguous()

    def put(self, target: str, source: str, shape: tuple[int, ...], *, transpose: bool = False) -> None:
        self.out[target] = self.take(source, shape, transpose=transpose)

    def finish(self, ignored: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        left = sorted(k for k in set(self.state) - self.used if not k.endswith(ignored))
        if left:
            raise UnsupportedModelError(
                f"{self.what}: the checkpoint has weights this adapter does not map: {left[:8]}"
                f"{' ...' if len(left) > 8 else ''}. The model uses a feature paradecode does not support."
            )
        return self.out


def tied_lm_head_ok(state: dict[str, torch.Tensor], embed_key: str, head_key: str = "lm_head.weight") -> bool:
    """True when the checkpoint's lm_head is absent or the very same values as the embedding."""
    return head_key not in state or torch.equal(state[head_key], state[embed_key])
