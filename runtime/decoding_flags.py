"""The decoding flags that paradecode-generate, paradecode-serve, paradecode-profile and paradecode-bench share, each
declared once with one help text and mapped to its `GenerationConfig` field.

`add_decoding_flags(parser, names)` adds the named flags (a parser or an argument group); `decoding_fields(args,
names)` gives the `GenerationConfig` fields the given ones ask for. A flag left out is None in `args` and keeps the
config's default, which lives in `GenerationConfig` only: the help texts read it from there. A command whose own
default differs (paradecode-profile shows both overlaps by default) passes it in `defaults`, and its help says so.
`help_of(name)` is the text alone, for a command that takes several values of the flag to try (paradecode-bench).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from paradecode.graphs.arguments import positive_float, positive_int
from paradecode.runtime.config import ADAPTIVE, ADAPTIVE_HELP, MODES, OVERLAPS, GenerationConfig, parse_threshold


@dataclass(frozen=True)
class DecodingFlag:
    """One flag: its name, the GenerationConfig field it sets, its help ({default} where the default goes), the
    argparse options that parse it, and how the parsed value becomes the field's."""

    name: str
    field: str
    help: str
    options: dict
    to_field: Callable[[Any], Any] = lambda value: value

    def default(self) -> Any:
        return GenerationConfig.__dataclass_fields__[self.field].default


def _text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


FLAGS = {
    flag.name: flag
    for flag in (
        DecodingFlag(
            "--max-new-tokens",
            "max_new_tokens",
            "new tokens to generate (default {default})",
            {"type": positive_int, "metavar": "N"},
        ),
        DecodingFlag(
            "--mode",
            "mode",
            "ar: plain decoding, one token per pass; paradecode: ParaDecode, the same tokens with early proposals "
            "verified (default {default})",
            {"choices": MODES},
        ),
        DecodingFlag(
            "--overlap",
            "overlap",
            "how pending layers are completed: on another lane at once (streams), batched with later tokens "
            "(batched), or both; auto: batched (the fastest measured on a CPU and on CUDA) (default {default})",
            {"choices": OVERLAPS},
        ),
        DecodingFlag(
            "--threshold",
            "thresholds",
            "exit threshold for every exit layer, in [0, 1], or 'never' (default: the export's; with --adaptive auto "
            "in the batched overlap none are called on CUDA, or on a CPU when sampling or with lookup on)",
            {"metavar": "G"},
            parse_threshold,
        ),
        DecodingFlag(
            "--max-unverified",
            "max_unverified",
            "most tokens decoded ahead of their verification by the final layer (default {default})",
            {"type": positive_int, "metavar": "K"},
        ),
        DecodingFlag(
            "--lookup",
            "lookup_tokens",
            "prompt lookup: propose up to N tokens that followed the earlier occurrences of the newest tokens "
            "(verified like early exits; 0: off) (default {default})",
            {"type": int, "metavar": "N"},
        ),
        DecodingFlag(
            "--draft-tokens",
            "draft_tokens",
            "the export's draft head (paradecode-export --draft-head) guesses up to N tokens where lookup has none "
            "(verified like lookup's; 0: off) (default {default})",
            {"type": int, "metavar": "N"},
        ),
        DecodingFlag("--adaptive", "adaptive", ADAPTIVE_HELP, {"choices": tuple(ADAPTIVE)}, ADAPTIVE.__getitem__),
        DecodingFlag(
            "--lookup-ngram",
            "lookup_max_ngram",
            "longest suffix lookup matches (default {default})",
            {"type": positive_int, "metavar": "N"},
        ),
        DecodingFlag(
            "--lookup-min-ngram",
            "lookup_min_ngram",
            "shortest suffix lookup matches (default {default})",
            {"type": positive_int, "metavar": "N"},
        ),
        DecodingFlag(
            "--lookup-length-factor",
            "lookup_length_factor",
            "lookup proposes at most F times as many tokens as its match is long (inf: no such limit) "
            "(default {default})",
            {"type": positive_float, "metavar": "F"},
        ),
    )
}
SHARED = tuple(FLAGS)  # the decoding flags, in the order --help lists them
SERVED = tuple(name for name in SHARED if name != "--max-new-tokens")  # a server's requests say their max_tokens


def help_of(name: str, default: Any = None) -> str:
    """The flag's help text, with `default` (None: GenerationConfig's) where it says its default."""
    flag = FLAGS[name]
    return flag.help.format(default=_text(flag.default() if default is None else default))


def add_decoding_flags(parser: Any, names: Iterable[str] = SHARED, *, defaults: dict[str, Any] | None = None) -> None:
    """Add the named flags to `parser` (an ArgumentParser or an argument group); each parses to None where not
    given, or to its entry in `defaults` (a parsed value)."""
    defaults = defaults or {}
    for name in names:
        flag = FLAGS[name]
        parser.add_argument(name, default=defaults.get(name), help=help_of(name, defaults.get(name)), **flag.options)


def decoding_fields(args: argparse.Namespace, names: Iterable[str] = SHARED) -> dict[str, Any]:
    """The GenerationConfig fields the named flags ask for, only those given (or defaulted by the command)."""
    fields = {}
    for name in names:
        flag = FLAGS[name]
        value = getattr(args, name.removeprefix("--").replace("-", "_"))
        if value is not None:
            fields[flag.field] = flag.to_field(value)
    return fields
