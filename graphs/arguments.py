"""argparse value types shared by every command line (export, runtime, serve, tools): one wording each."""

from __future__ import annotations

import argparse
import math

MAX_TEMPERATURE = 2.0  # OpenAI's cap, which paradecode-serve applies too


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value:g}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: a finite number in [0, MAX_TEMPERATURE] (0: greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, {MAX_TEMPERATURE:g}], got {text!r}") from None
    if not (math.isfinite(value) and 0 <= value <= MAX_TEMPERATURE):
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, {MAX_TEMPERATURE:g}] (0 decodes greedily; OpenAI's and paradecode-serve's "
            f"cap is {MAX_TEMPERATURE:g}), got {text}"
        )
    return value
