"""`GenerationConfig`: the settings of one generate call, validated on construction; defaults live here."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from paradecode.graphs.errors import UserInputError
from paradecode.graphs.manifest import NEVER_EXIT as NEVER  # the documented "never exit" threshold (math.inf)
from paradecode.runtime import policy
from paradecode.runtime.lookup import LookupConfig
from paradecode.runtime.sampling import SamplingParams

MODES = ("ar", "paradecode")
OVERLAPS = ("auto", "streams", "batched", "both")
ADAPTIVE = {"auto": None, "on": True, "off": False}  # `adaptive` by the name the command-line tools take
ADAPTIVE_HELP = (  # the command-line tools' --adaptive (GenerationConfig.adaptive says why)
    "call exit heads and propose lookup tokens only while measured costs and acceptance say they pay: auto (default: "
    "with the export's thresholds in the batched overlap, no exit heads on CUDA, nor on a CPU when sampling or with "
    "lookup on, measured not to pay; greedy CPU decoding with --lookup 0 adapts its exits), on, or off (the "
    "export's thresholds as they are)"
)


def parse_threshold(text: str) -> float:
    """A threshold as the CLI takes it: a number in [0, 1], or `never`."""
    if text.strip().lower() in ("never", "inf"):
        return NEVER
    try:
        return float(text)
    except ValueError:
        raise UserInputError(f"threshold {text!r} is not a number; expected a value in [0, 1] or 'never'.") from None


def check_threshold(value: float, where: str = "threshold") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserInputError(f"{where} must be a number in [0, 1] or NEVER (math.inf), got {value!r}.")
    value = float(value)
    if value == NEVER or 0.0 <= value <= 1.0:
        return value
    raise UserInputError(
        f"{where} {value!r} is outside [0, 1]. A token exits when its top-1 probability reaches the threshold: "
        "0 exits every token, 1 only certain ones; use 'never' (math.inf in Python) to disable early exits."
    )


def is_integer(value) -> bool:
    """An integer, numpy's included; not a bool (True is an int in Python, never a count or a token here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_integer(value, name: str, what: str = "") -> int:
    if not is_integer(value) or value < 1:
        raise UserInputError(f"{name}{what} must be a positive integer, got {value!r}.")
    return int(value)


def check_token_ids(ids: Iterable, name: str) -> list[int]:
    """Token ids as a list of ints; floats, bools, strings and other types are refused, never truncated."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise UserInputError(f"{name} must be a list of integer token ids, got {type(ids).__name__}.")
    ids = list(ids)
    bad = [i for i in ids if not is_integer(i)]
    if bad:
        raise UserInputError(f"{name} must hold integer token ids; got {bad[:3]!r} ({type(bad[0]).__name__}).")
    return [int(i) for i in ids]


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
    # Prompt lookup (runtime/lookup.py): the most tokens proposed at once (0: off), the longest and shortest
    # suffix matched, and a proposal's longest length as a multiple of its match's (runtime/policy.py's "lookup"
    # row has the measurements that chose them).
    lookup_tokens: int = 5
    lookup_max_ngram: int = 16
    lookup_min_ngram: int = 2
    lookup_length_factor: float = 1.0
    # Lookup also proposes what earlier requests' outputs on this loaded model continued with (where the request's
    # own prompt and output have no match), and this request's output joins them (runtime/lookup.py,
    # SharedSuffixIndex). Proposals are verified, so outputs do not change; only their speed can tell that
    # an earlier request produced the same text. Off by default (runtime/policy.py's "shared lookup" row).
    lookup_shared: bool = False
    # The draft head (an export made with --draft-head, runtime/proposers.py `DraftProposer`): the most tokens it
    # guesses at once where lookup has none (0: off, the default: issue 58 sets it from measurements).
    draft_tokens: int = 0
    # Sampling (runtime/sampling.py): temperature 0 is greedy; top_k 0 and top_p 1 are no limit; seed None
    # draws one (recorded in the result's stats, so the run can be reproduced).
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # Adaptive speculation (runtime/speculation.py): call exit heads and propose lookup tokens only while the
    # measured acceptance and call costs say they pay. True / False: on / off (False: the export's thresholds as
    # they are). None: the machine's default for the request (`adapts`, `skips_exits`: runtime/policy.py's rows,
    # with the measurements that chose them); explicit thresholds are used as given.
    adaptive: bool | None = None

    def __post_init__(self) -> None:
        positive_integer(self.max_new_tokens, "max_new_tokens")
        if self.mode not in MODES:
            raise UserInputError(f"mode {self.mode!r} is not one of {', '.join(MODES)}.")
        if self.overlap not in OVERLAPS:
            raise UserInputError(f"overlap {self.overlap!r} is not one of {', '.join(OVERLAPS)}.")
        positive_integer(self.max_unverified, "max_unverified", " (K)")
        if isinstance(self.thresholds, Mapping):
            for layer, value in self.thresholds.items():
                if not is_integer(layer):
                    raise UserInputError(f"thresholds are keyed by exit layer numbers, got the key {layer!r}.")
                check_threshold(value, f"threshold for exit layer {layer}")
        elif self.thresholds is not None:
            check_threshold(self.thresholds)
        if self.adaptive is not None and not isinstance(self.adaptive, bool):
            raise UserInputError(f"adaptive must be True, False or None (automatic), got {self.adaptive!r}.")
        for name in ("ignore_eos", "lookup_shared"):
            if not isinstance(getattr(self, name), bool):
                raise UserInputError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if not is_integer(self.lookup_tokens) or self.lookup_tokens < 0:
            raise UserInputError(
                f"lookup_tokens must be a non-negative integer (0 turns lookup off), got {self.lookup_tokens!r}."
            )
        if not is_integer(self.draft_tokens) or self.draft_tokens < 0:
            raise UserInputError(
                f"draft_tokens must be a non-negative integer (0 turns the draft head off), got {self.draft_tokens!r}."
            )
        self.lookup_config()  # validates the match lengths and the length factor
        self._check_sampling()
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # one string is one stop string
        if not isinstance(stop, Iterable) or not all(isinstance(s, str) for s in stop):
            raise UserInputError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        object.__setattr__(self, "stop", tuple(stop))
        if any(not s for s in self.stop):
            raise UserInputError("stop strings must not be empty.")

    def _check_sampling(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
                raise UserInputError(f"{name} must be a number, got {value!r}.")
        if math.isinf(self.temperature):
            raise UserInputError(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if self.temperature < 0:
            raise UserInputError(
                f"temperature must be >= 0, got {self.temperature!r}: 0 decodes greedily, higher values sample from "
                "flatter distributions."
            )
        if not 0 < self.top_p <= 1:
            raise UserInputError(f"top_p must be in (0, 1], got {self.top_p!r}: 1 keeps every token.")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise UserInputError(f"top_k must be a non-negative integer, got {self.top_k!r}: 0 keeps every token.")
        if self.seed is not None and not is_integer(self.seed):
            raise UserInputError(f"seed must be an integer or None, got {self.seed!r}.")
        if self.seed is not None and self.seed < 0:
            raise UserInputError(f"seed must be >= 0, got {self.seed!r}.")

    def sampling(self, seed: int) -> SamplingParams | None:
        """The sampling settings with `seed` (the request's or a drawn one), None for greedy decoding."""
        if self.temperature == 0:
            return None
        return SamplingParams(float(self.temperature), int(self.top_k), float(self.top_p), int(seed))

    def lookup_config(self) -> LookupConfig | None:
        """The prompt-lookup settings, None when lookup is off."""
        config = LookupConfig(
            max_ngram=self.lookup_max_ngram,
            min_ngram=self.lookup_min_ngram,
            max_tokens=max(1, self.lookup_tokens),
            length_factor=self.lookup_length_factor,
        )
        return config if self.lookup_tokens else None

    def adapts(self, device: str, overlap: str = "batched") -> bool:
        """Whether ParaDecode adapts its speculation to measured costs and acceptance (see `adaptive`); `overlap`
        is the resolved one (its cost model is `batched`'s)."""
        if self.adaptive is not None:
            return self.adaptive
        settings = (self.temperature, self.lookup_tokens, self.draft_tokens)
        return self.thresholds is None and policy.adapts(device, overlap, *settings)

    def decodes_plainly(self, alone: bool, overlap: str) -> bool:
        """Whether `adaptive` None, with the export's thresholds, decides that ParaDecode decodes as plain decoding:
        where the machine's row form runs every position `alone` in the resolved `overlap` (runtime/policy.py)."""
        if self.adaptive is not None or self.thresholds is not None:
            return False
        return policy.decodes_plainly(alone, overlap)

    def skips_exits(self, device: str, overlap: str) -> bool:
        """Whether `adaptive` None decides to call no exit heads (lookup still proposes), with the export's
        thresholds: where runtime/policy.py measured them not to pay. `overlap` is the resolved one."""
        if self.adaptive is not None or self.thresholds is not None:
            return False
        return policy.skips_exits(device, overlap, self.temperature, self.lookup_tokens)

    def resolve_thresholds(self, defaults: Mapping[int, float], device: str, overlap: str) -> dict[int, float]:
        """Thresholds per exit layer: the export's defaults, overridden by this config; none where the defaults
        skip exits on this device and resolved overlap (`skips_exits`)."""
        if self.thresholds is None:
            if self.skips_exits(device, overlap):
                return dict.fromkeys(defaults, NEVER)
            return dict(defaults)
        if isinstance(self.thresholds, Mapping):
            unknown = sorted(set(self.thresholds) - set(defaults))
            if unknown:
                raise UserInputError(
                    f"thresholds given for layers {unknown}, but the export's exit layers are {sorted(defaults)}."
                )
            return {**defaults, **{int(k): float(v) for k, v in self.thresholds.items()}}
        return {layer: float(self.thresholds) for layer in defaults}
