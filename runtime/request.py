"""A request, resolved once: `resolve(facts, config, ids, seed)` makes the frozen `Request` an engine decodes.

Everything a request's decoding depends on is settled here, from three things: the loaded model's frozen facts
(`ModelFacts`: its export's limits, thresholds and heads, its device and this machine's row form), the request's
settings (`GenerationConfig`) and its prompt's token ids. What comes out (`Request`) is immutable: the mode and
overlap as they will run (ParaDecode decodes as plain decoding where it could not keep its output or could not pay),
the thresholds per exit layer, whether speculation adapts, the sampling parameters with their seed, where decoding
stops, and the warnings the model says once. A bad request raises `UserInputError` here, before it holds anything:
`paradecode-serve` resolves on its preparing threads, so a bad request is answered before it is queued, and the
engine never checks a request again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from paradecode.graphs.errors import PromptError, PromptTooLongError, SettingError, UserInputError
from paradecode.runtime import policy
from paradecode.runtime.config import GenerationConfig
from paradecode.runtime.lookup import LookupConfig
from paradecode.runtime.row_exactness import RowForm
from paradecode.runtime.sampling import SamplingParams
from paradecode.runtime.stops import Stops

# Warnings a request's settings make a model say (once per runtime: `runtime.notices.Notices`), by name.
INEXACT, ALONE, IDLE = "inexact", "alone", "idle"
UNTRAINED, UNTRAINED_NO_LOOKUP = "untrained", "untrained_no_lookup"


@dataclass(frozen=True)
class ModelFacts:
    """What requests are resolved against: a loaded model's facts, which never change while it is loaded."""

    name: str  # the export folder's name, for messages
    path: str  # the export folder, for messages
    vocab_size: int
    capacity: int  # positions a sequence may take (the KV cache's slots, less a row form's spare ones)
    eos: tuple[int, ...]
    thresholds: Mapping[int, float]  # the export's, per exit layer
    trained_heads: bool
    draft_head: bool  # the export has a draft head's graph
    with_logits: bool
    has_tokenizer: bool
    device: str  # "cpu" or "cuda"
    row_form: RowForm | None  # how calls are made exact on this machine (None: no form does)


@dataclass(frozen=True)
class Request:
    """A resolved request: its prompt's token ids, its settings as they will run and everything derived from them
    (no raw settings: what decoding reads is here, resolved)."""

    ids: tuple[int, ...]
    mode: str  # "ar" or "paradecode", as it will run
    overlap: str  # `auto` resolved for the device; meaningful for ParaDecode only
    thresholds: Mapping[int, float]  # per exit layer, as ParaDecode uses them (empty for plain decoding)
    adaptive: bool  # speculation adapts to measured costs and acceptance
    max_unverified: int  # K: tentative tokens ahead of the newest verified one
    lookup: LookupConfig | None  # prompt lookup's settings (None: off)
    lookup_shared: bool  # lookup also reads, and adds to, the outputs of the model's earlier requests
    draft_tokens: int  # the draft head's guesses per chain (0: off)
    sampling: SamplingParams | None  # None: greedy; else with the request's seed (drawn where it gave none)
    stop: tuple[str, ...]  # stop strings (found in the output's text: runtime/stops.py `Completion`)
    stops: Stops
    warnings: tuple[tuple[str, tuple], ...] = ()  # (name, arguments) to say once per model

    @property
    def speculates(self) -> bool:
        return self.mode == "paradecode"


def resolve(facts: ModelFacts, config: GenerationConfig, ids: list[int], seed: int) -> Request:
    """The request for `config` after the prompt `ids` on a model of `facts`: checked completely (UserInputError
    names what is wrong), its mode as it will run, its thresholds, adaptation, sampling (`seed` where `config` has
    none) and stops. Pure: the same arguments give the same request."""
    if not isinstance(config, GenerationConfig):
        raise UserInputError(f"config must be a GenerationConfig, got {type(config).__name__}.")
    check_prompt(facts, ids)
    if config.stop and not facts.has_tokenizer:
        raise SettingError(
            f"stop strings {list(config.stop)!r} need the export's tokenizer to read the output as text, and "
            f"{facts.path} has none: leave out the stop strings (stop on max_new_tokens or an end-of-sequence "
            "token), or export the model with its tokenizer.",
            "stop",
        )
    if config.temperature != 0 and not facts.with_logits:
        raise SettingError(
            f"sampling (temperature {config.temperature}) needs the heads' logits, and {facts.path} was exported "
            "with --no-logits: re-export without it, or decode greedily (temperature 0).",
            "temperature",
        )
    if config.draft_tokens and not facts.draft_head:
        raise SettingError(
            f"draft_tokens {config.draft_tokens} asks for the export's draft head, and {facts.path} has none: "
            "re-export the model with `paradecode-export --draft-head FILE`, or leave draft_tokens at 0.",
            "draft_tokens",
        )
    warnings: list[tuple[str, tuple]] = []
    form = facts.row_form
    overlap = config.overlap if config.overlap != "auto" else policy.auto_overlap(facts.device)
    # Decoded as plain decoding: where ParaDecode could not keep plain decoding's output (no exact form), and where
    # every position has a call of its own, so on one lane no speculation can pay
    if config.mode == "paradecode" and form is None:
        warnings.append((INEXACT, (facts.name,)))
        config = replace(config, mode="ar")
    if config.mode == "paradecode" and config.decodes_plainly(form.alone, overlap):
        warnings.append((ALONE, (facts.name,)))
        config = replace(config, mode="ar")
    thresholds: dict[int, float] = {}
    adaptive = False
    if config.mode == "paradecode":
        thresholds = config.resolve_thresholds(facts.thresholds, facts.device, overlap)
        adaptive = config.adapts(facts.device, overlap)
        proposes = config.lookup_tokens or config.draft_tokens  # tokens beside the exit heads'
        if config.skips_exits(facts.device, overlap) and not proposes:
            warnings.append((IDLE, ("on CUDA" if facts.device == "cuda" else "when sampling on a CPU",)))
        if config.thresholds is None and not facts.trained_heads:
            warnings.append((UNTRAINED if proposes else UNTRAINED_NO_LOOKUP, (facts.path,)))
    stops = Stops(len(ids), config.max_new_tokens, frozenset(() if config.ignore_eos else facts.eos), facts.capacity)
    return Request(
        ids=tuple(ids),
        mode=config.mode,
        overlap=overlap,
        thresholds=MappingProxyType(thresholds),
        adaptive=adaptive,
        max_unverified=config.max_unverified,
        lookup=config.lookup_config(),
        lookup_shared=config.lookup_shared,
        draft_tokens=config.draft_tokens,
        sampling=config.sampling(config.seed if config.seed is not None else seed),
        stop=tuple(config.stop),
        stops=stops,
        warnings=tuple(warnings),
    )


def check_prompt(facts: ModelFacts, ids: list[int]) -> None:
    """A prompt's token ids: at least one, each in the vocabulary, no more than the KV cache holds."""
    if not ids:
        raise PromptError("the prompt is empty: give at least one token (a BOS token for an empty text).")
    bad = [i for i in ids if not 0 <= i < facts.vocab_size]
    if bad:
        raise PromptError(f"prompt ids {bad[:5]} are outside the vocabulary (0..{facts.vocab_size - 1}).")
    if len(ids) > facts.capacity:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens, more than the export's KV cache holds ({facts.capacity} positions, "
            "set by --max-seq-len at export). Shorten the prompt or re-export with a larger --max-seq-len."
        )
