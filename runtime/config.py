"""`GenerationConfig`: the settings of one generate call, validated on construction; defaults live here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.manifest import NEVER_EXIT as NEVER  # the documented "never exit" threshold (math.inf)

MODES = ("ar", "paradecode")
OVERLAPS = ("auto", "streams", "batched", "both")


def parse_threshold(text: str) -> float:
    """A threshold as the CLI takes it: a number in [0, 1], or `never`."""
    if text.strip().lower() in ("never", "inf"):
        return NEVER
    try:
        return float(text)
    except ValueError:
        raise UserInputError(f"threshold {text!r} is not a number; expected a value in [0, 1] or 'never'.") from None


def check_threshold(value: float, where: str = "threshold") -> float:
    value = float(value)
    if value == NEVER or 0.0 <= value <= 1.0:
        return value
    raise UserInputError(
        f"{where} {value!r} is outside [0, 1]. A token exits when its top-1 probability reaches the threshold: "
        "0 exits every token, 1 only certain ones; use 'never' (math.inf in Python) to disable early exits."
    )


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode. `thresholds`: None uses the export's (per exit layer); a float applies to every
    exit layer; a mapping sets some layers. `overlap` says how pending layers are completed:
    on other lanes right away (`streams`), batched into later tokens' calls (`batched`), or both."""

    max_new_tokens: int = 64
    mode: str = "paradecode"
    overlap: str = "auto"
    thresholds: float | Mapping[int, float] | None = None
    max_unverified: int = 5
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise UserInputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}.")
        if self.mode not in MODES:
            raise UserInputError(f"mode {self.mode!r} is not one of {', '.join(MODES)}.")
        if self.overlap not in OVERLAPS:
            raise UserInputError(f"overlap {self.overlap!r} is not one of {', '.join(OVERLAPS)}.")
        if not isinstance(self.max_unverified, int) or self.max_unverified < 1:
            raise UserInputError(f"max_unverified (K) must be a positive integer, got {self.max_unverified!r}.")
        if isinstance(self.thresholds, Mapping):
            for layer, value in self.thresholds.items():
                check_threshold(value, f"threshold for exit layer {layer}")
        elif self.thresholds is not None:
            check_threshold(self.thresholds)
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not s for s in self.stop):
            raise UserInputError("stop strings must not be empty.")

    def resolve_thresholds(self, defaults: Mapping[int, float]) -> dict[int, float]:
        """Thresholds per exit layer: the export's defaults, overridden by this config."""
        if self.thresholds is None:
            return dict(defaults)
        if isinstance(self.thresholds, Mapping):
            unknown = sorted(set(self.thresholds) - set(defaults))
            if unknown:
                raise UserInputError(
                    f"thresholds given for layers {unknown}, but the export's exit layers are {sorted(defaults)}."
                )
            return {**defaults, **{int(k): float(v) for k, v in self.thresholds.items()}}
        return {layer: float(self.thresholds) for layer in defaults}
