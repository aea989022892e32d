"""The measurement harness every tool shares: named modes, warm-up, interleaving, and the statistics.

A mode is a named way to decode one prompt: `run(prompt_ids, max_new_tokens) -> Sample`. `measure`
warms every mode up, then runs every mode on a prompt before the next prompt, and every prompt
`repeat` times (A B C A B C ...), in one process, so drift and heat touch every mode alike (docs/design.md
§6). `Results` holds the samples and computes what the tools report: per-mode medians with min and
max, the baseline (the fastest mode of kind `ar`: plain decoding in its best thread setting),
speedup ratios against it, latency percentiles, exits and output matches.

Nothing here knows about models: the modes do (`paradecode.tools.bench_modes` makes them), so the
harness runs as well on fake modes that return canned samples.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from paradecode.graphs.errors import ParadecodeError, UserInputError

logger = logging.getLogger(__name__)


class ModeFailed(ParadecodeError):
    """A mode that cannot run any more (a peer whose process died): `measure` leaves it out of the rest of the run,
    its samples too, and says why in `Results.skipped`."""


@dataclass(kw_only=True)
class Sample:
    """One decode of one prompt. `measure` fills in mode, prompt, repeat and (unless the mode measured its own)
    peak_rss_mb."""

    mode: str = ""
    prompt: int = 0  # index into the prompts
    repeat: int = 0
    token_ids: list[int]
    first_token_seconds: float = 0.0  # from the call to the first new token (prefill)
    timestamps: list[float] = field(default_factory=list)  # perf_counter time of each verified token, if kept
    exits: dict[int, int] = field(default_factory=dict)  # early tokens proposed per exit layer
    accepted: dict[int, int] = field(default_factory=dict)  # ... and verified
    lookup_proposed: int = 0  # tokens proposed by prompt lookup
    lookup_accepted: int = 0  # ... and verified
    draft_proposed: int = 0  # tokens guessed by the draft head
    draft_accepted: int = 0  # ... and verified
    rollbacks: int = 0
    peak_rss_mb: float | None = None  # growth of the process's peak RSS during the run (Linux)
    tokens_per_second: float  # new tokens after the first, per second after the first

    @classmethod
    def from_stamps(cls, token_ids: list[int], started: float, stamps: list[float], **fields: Any) -> Sample:
        """A sample timed per token: tokens/s is (new tokens - 1) over the time from the first new token to
        the last (the prefill is `first_token_seconds`, on its own)."""
        span = stamps[-1] - stamps[0] if len(stamps) >= 2 else 0.0
        return cls(
            token_ids=token_ids,
            first_token_seconds=stamps[0] - started if stamps else 0.0,
            timestamps=stamps,
            tokens_per_second=(len(stamps) - 1) / span if span > 0 else 0.0,
            **fields,
        )

    @property
    def latencies(self) -> list[float]:
        """Seconds between consecutive verified tokens (empty where the mode keeps no timestamps)."""
        return [b - a for a, b in zip(self.timestamps, self.timestamps[1:])]


@dataclass(frozen=True)
class Mode:
    """A way to decode: `run(prompt_ids, max_new_tokens)` returns a Sample (mode/prompt/repeat left empty)."""

    name: str
    kind: str  # "ar" (a baseline candidate), "paradecode", "hf" or "peer" (another runtime: tools/peers.py)
    run: Callable[[list[int], int], Sample]
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Spread:
    """The median of some measurements, with their min and max."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        values = list(values)
        return cls(statistics.median(values), min(values), max(values)) if values else None

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def measure(
    modes: Sequence[Mode],
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    repeat: int,
    warmup_tokens: int = 16,
    skip_failing: bool = False,
) -> Results:
    """Warm every mode up on the first prompt, then run every mode on every prompt, interleaved, `repeat` times.

    With `skip_failing`, a mode whose warm-up raises (one the model or library does not support) is
    reported and left out (`Results.skipped` says why); otherwise the error propagates. A mode that raises
    `ModeFailed`, in its warm-up or later, is left out whatever `skip_failing` says, its samples dropped: the other
    modes' run goes on.
    """
    if not modes or not prompts or repeat < 1:
        raise UserInputError(f"need modes, prompts and repeat >= 1; got {len(modes)}, {len(prompts)}, {repeat}.")
    names = [m.name for m in modes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserInputError(f"modes must have distinct names; {twice} appear more than once (a setting given twice?).")
    runs_per_mode = repeat * len(prompts)
    skipped: dict[str, str] = {}
    samples: list[Sample] = []
    with logging_redirect_tqdm(), tqdm(total=len(modes) * (1 + runs_per_mode), desc="measuring", unit="run") as bar:
        active = []
        for mode in modes:
            bar.set_postfix(mode=mode.name, prompt="warm-up")
            try:
                mode.run(prompts[0], warmup_tokens)
            except ModeFailed as err:
                skipped[mode.name] = str(err)
                logger.warning("leaving %s out: %s", mode.name, err)
                bar.total -= runs_per_mode
            except Exception as err:
                if not skip_failing:
                    raise
                skipped[mode.name] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"
                logger.info("skipping %s: %s", mode.name, skipped[mode.name])
                bar.total -= runs_per_mode
            else:
                active.append(mode)
            bar.update()
        for r in range(repeat):
            for p, prompt in enumerate(prompts):
                for mode in list(active):
                    bar.set_postfix(mode=mode.name, prompt=f"{p + 1}/{len(prompts)}", repeat=f"{r + 1}/{repeat}")
                    try:
                        samples.append(_timed(mode, prompt, max_new_tokens, p, r))
                    except ModeFailed as err:
                        done = sum(s.mode == mode.name for s in samples)
                        samples = [s for s in samples if s.mode != mode.name]
                        active.remove(mode)
                        skipped[mode.name] = str(err)
                        logger.warning("leaving %s out after %d of its runs: %s", mode.name, done, err)
                        bar.total -= runs_per_mode - done - 1
                    bar.update()
    return Results(list(modes), samples, skipped)


def _timed(mode: Mode, prompt: list[int], max_new_tokens: int, p: int, r: int) -> Sample:
    before = peak_rss_reset()
    sample = mode.run(prompt, max_new_tokens)
    peak = status_mb("VmHWM") if before is not None else None
    if sample.peak_rss_mb is None:  # a mode decoding in another process measures its own
        sample = replace(sample, peak_rss_mb=None if peak is None else max(0.0, peak - before))
    return replace(sample, mode=mode.name, prompt=p, repeat=r)


def peak_rss_reset() -> float | None:
    """Reset the process's peak RSS (Linux) and return the current RSS in MB; None where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return status_mb("VmRSS")
    except OSError:
        return None


def status_mb(key: str) -> float | None:
    """A size from /proc/self/status (VmRSS, VmHWM) in MB; None where it is not there."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return None


@dataclass(frozen=True)
class Results:
    """The samples of one `measure` call, and the figures the tools report from them."""

    modes: list[Mode]
    samples: list[Sample]
    skipped: dict[str, str] = field(default_factory=dict)  # mode name -> why it was left out

    def of_prompts(self, prompts: Iterable[int]) -> Results:
        """The same modes with only the samples of these prompts (indices): one category's, say."""
        keep = set(prompts)
        return replace(self, samples=[s for s in self.samples if s.prompt in keep])

    def runs(self, name: str | None) -> list[Sample]:
        return [s for s in self.samples if s.mode == name]

    def tokens_per_second(self, name: str) -> Spread | None:
        """Median, min and max tokens/s over every run of the mode (each prompt in each repeat)."""
        return Spread.of(s.tokens_per_second for s in self.runs(name))

    @property
    def baseline(self) -> str | None:
        """The fastest mode of kind `ar` (median tokens/s): *the* plain-decoding baseline."""
        rates = {m.name: self.tokens_per_second(m.name) for m in self.modes if m.kind == "ar"}
        measured = [n for n, rate in rates.items() if rate is not None]
        return max(measured, key=lambda n: rates[n].median, default=None)

    def speedup(self, name: str, against: str | None, *, per: Literal["repeat", "run"] = "repeat") -> Spread | None:
        """Ratios of tokens/s against another mode: median, min and max.

        per="repeat": one ratio per repeat, of the modes' medians over the prompts of that repeat.
        per="run": one ratio per run (prompt and repeat), each against the other mode's same run.
        """
        if per not in ("repeat", "run"):
            raise ValueError(f"per must be 'repeat' or 'run', got {per!r}")
        if against is None:
            return None
        mine, theirs = self._rates_by(name, per), self._rates_by(against, per)
        return Spread.of(mine[k] / theirs[k] for k in mine if theirs.get(k, 0) > 0)

    def _rates_by(self, name: str, per: str) -> dict[Any, float]:
        groups: dict[Any, list[float]] = {}
        for s in self.runs(name):
            groups.setdefault(s.repeat if per == "repeat" else (s.prompt, s.repeat), []).append(s.tokens_per_second)
        return {key: statistics.median(values) for key, values in groups.items()}

    def latency_ms(self, name: str, percentiles: Sequence[float]) -> list[float]:
        """Percentiles (0-100) of the gaps between consecutive tokens over every run, in ms (NaN without any).

        The nearest-rank value (numpy's method="nearest"): always a measured gap, never an interpolation.
        """
        gaps = [x for s in self.runs(name) for x in s.latencies]
        if not gaps:
            return [float("nan")] * len(percentiles)
        return [1e3 * float(v) for v in np.percentile(gaps, list(percentiles), method="nearest")]

    def matches(self, name: str, against: str | None) -> int:
        """How many runs of the mode gave the same tokens as `against` on the same prompt and repeat."""
        reference = {(s.prompt, s.repeat): s.token_ids for s in self.runs(against)}
        return sum(s.token_ids == reference.get((s.prompt, s.repeat)) for s in self.runs(name))

    def leading_match(self, name: str, against: str | None) -> float | None:
        """The share of identical leading tokens against `against` (same prompt and repeat), averaged over runs.

        A run's share is the length of the common prefix over the longer of the two outputs (an output
        that stops early is not in full agreement); None where `against` has no run to compare with.
        """
        reference = {(s.prompt, s.repeat): s.token_ids for s in self.runs(against)}
        shares = [
            common_prefix_share(s.token_ids, reference[(s.prompt, s.repeat)])
            for s in self.runs(name)
            if (s.prompt, s.repeat) in reference
        ]
        return statistics.fmean(shares) if shares else None

    def identical_per_prompt(self, name: str, against: str | None) -> dict[str, bool]:
        """Per prompt (index, as a string): whether every repeat gave exactly the tokens `against` gave."""
        reference = {(s.prompt, s.repeat): s.token_ids for s in self.runs(against)}
        same: dict[str, bool] = {}
        for s in self.runs(name):
            key = str(s.prompt)
            same[key] = same.get(key, True) and s.token_ids == reference.get((s.prompt, s.repeat))
        return same

    def exits(self, name: str) -> dict[str, int]:
        """Early tokens proposed per exit layer over every run (keys as strings, in layer order)."""
        return _total(s.exits for s in self.runs(name))

    def accepted(self, name: str) -> dict[str, int]:
        """Early tokens verified per exit layer over every run (keys as strings, in layer order)."""
        return _total(s.accepted for s in self.runs(name))

    def lookup(self, name: str) -> tuple[int, int]:
        """Tokens proposed by prompt lookup and verified, over every run."""
        runs = self.runs(name)
        return sum(s.lookup_proposed for s in runs), sum(s.lookup_accepted for s in runs)

    def draft(self, name: str) -> tuple[int, int]:
        """Tokens guessed by the draft head and verified, over every run."""
        runs = self.runs(name)
        return sum(s.draft_proposed for s in runs), sum(s.draft_accepted for s in runs)

    def rollbacks(self, name: str) -> int:
        return sum(s.rollbacks for s in self.runs(name))


def common_prefix_share(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """The length of the common prefix over the longer sequence's: [1, 2, 3] vs [1, 2, 4, 5] -> 2 / 4."""
    longest = max(len(tokens), len(reference))
    if longest == 0:
        return 1.0
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    return same / longest


def _total(dicts: Iterable[dict[int, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[str(k)] = total.get(str(k), 0) + v
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))
