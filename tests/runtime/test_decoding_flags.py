"""The decoding flags declared once (runtime/decoding_flags.py): the same help in paradecode-generate,
paradecode-serve and paradecode-profile, and the same GenerationConfig from the same flags."""

from __future__ import annotations

import argparse
import math

import pytest

from paradecode.runtime.cli import build_parser as generate_parser
from paradecode.runtime.cli import config_of
from paradecode.runtime.config import NEVER, GenerationConfig
from paradecode.runtime.decoding_flags import FLAGS, SERVED, SHARED, add_decoding_flags, decoding_fields, help_of
from paradecode.runtime.serve.cli import build_parser as serve_parser
from paradecode.runtime.serve.cli import configs_of
from paradecode.tools.profiler import build_parser as profile_parser


def helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {o: a.help for a in parser._actions for o in a.option_strings}


def test_every_command_shows_one_help_text_per_flag():
    generate, serve, profile = helps(generate_parser()), helps(serve_parser()), helps(profile_parser())
    assert len(SHARED) == 11 and set(SERVED) == set(SHARED) - {"--max-new-tokens"}
    for name in SHARED:
        assert generate[name] == help_of(name), name
        assert name not in SERVED or serve[name] == generate[name], name
        assert name == "--overlap" or profile[name] == generate[name], name
    assert profile["--overlap"] == help_of("--overlap", "both") != generate["--overlap"]
    assert "(default both)" in profile["--overlap"] and "(default auto)" in generate["--overlap"]
    assert f"(default {GenerationConfig.max_unverified})" in generate["--max-unverified"]  # the config's own


FLAGS_GIVEN = [
    "--mode", "ar", "--overlap", "streams", "--threshold", "never", "--max-unverified", "3", "--lookup", "0",
    "--draft-tokens", "2", "--adaptive", "off", "--lookup-ngram", "8", "--lookup-min-ngram", "3",
    "--lookup-length-factor", "inf",
]  # fmt: skip
ASKED = {
    "mode": "ar",
    "overlap": "streams",
    "thresholds": NEVER,
    "max_unverified": 3,
    "lookup_tokens": 0,
    "draft_tokens": 2,
    "adaptive": False,
    "lookup_max_ngram": 8,
    "lookup_min_ngram": 3,
    "lookup_length_factor": math.inf,
}


def test_the_same_flags_make_the_same_config_in_generate_and_serve(tmp_path):
    generated = config_of(generate_parser().parse_args(["x", "--prompt", "hi", "--max-new-tokens", "9", *FLAGS_GIVEN]))
    served = configs_of(serve_parser().parse_args([str(tmp_path), *FLAGS_GIVEN]))[0].generation
    for field, value in ASKED.items():
        assert getattr(generated, field) == value == getattr(served, field), field
    assert generated.max_new_tokens == 9
    assert config_of(generate_parser().parse_args(["x", "--prompt", "hi"])) == GenerationConfig()  # none given
    assert configs_of(serve_parser().parse_args([str(tmp_path)]))[0].generation == GenerationConfig()


def test_a_flag_left_out_is_not_a_field_and_a_command_default_is():
    parser = argparse.ArgumentParser()
    add_decoding_flags(parser, ["--overlap", "--threshold", "--adaptive"], defaults={"--overlap": "both"})
    assert decoding_fields(parser.parse_args([]), ["--overlap", "--threshold", "--adaptive"]) == {"overlap": "both"}
    asked = parser.parse_args(["--threshold", "0.25", "--adaptive", "auto"])
    assert decoding_fields(asked, ["--threshold", "--adaptive"]) == {"thresholds": 0.25, "adaptive": None}
    with pytest.raises(SystemExit):  # argparse's own refusal, with the choices
        parser.parse_args(["--overlap", "sideways"])
    assert {flag.field for flag in FLAGS.values()} <= set(GenerationConfig.__dataclass_fields__)
