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


# OpenAI's seed is a signed 64-bit integer; paradecode-serve takes unsigned 64-bit ones too. The sampler's seed is the
# unsigned one: a negative seed wraps as two's complement does (-1 is 2**64 - 1), in the server and the CLI alike.
SEED_RANGE = (-(2**63), 2**64 - 1)


def seed_of(value: int) -> int:
    """The sampler's seed (0 to 2**64 - 1) of a seed in SEED_RANGE."""
    return value % 2**64


def seed(text: str) -> int:
    """A sampling seed in SEED_RANGE (paradecode-serve's bounds), as the sampler's seed (`seed_of`)."""
    low, high = SEED_RANGE
    expected = f"an integer from {low} to {high} (-2**63 to 2**64 - 1, the seeds paradecode-serve takes)"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return seed_of(value)
