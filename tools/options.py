"""argparse pieces the tools' command lines share: choices come from the runtime's own constants."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def choice_list(choices: Iterable[str], what: str) -> Callable[[str], tuple[str, ...]]:
    """An argparse `type` for comma-separated values, each one of `choices` (`--overlaps batched,both`)."""
    allowed = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"{what} {text!r}: expected comma-separated values from {', '.join(allowed)}"
                + (f"; not {', '.join(map(repr, bad))}" if bad else "")
            )
        return values

    return parse
