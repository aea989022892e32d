#!/usr/bin/env bash
# The test command README.md gives: set up .venv (tools/bootstrap.sh), check the code with ruff
# (lint and format), then run pytest with any arguments given, e.g. `tools/test.sh -m "not slow"`.
# pytest's exit code is the result, so "no tests ran" (exit code 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
