#!/usr/bin/env bash
# Set up .venv for paradecode on a fresh machine: the pinned CPU build of torch first (so nothing
# pulls the multi-GB CUDA wheels), then the project in editable mode with its test extras.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
