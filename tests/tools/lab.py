"""The measurement scripts of tools/lab/ (in the repository, not in the wheel), imported by path for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

LAB = Path(__file__).resolve().parents[2] / "tools" / "lab"


def lab_script(name: str) -> ModuleType:
    """tools/lab/NAME.py as a module (once per process: its dataclasses need it in sys.modules)."""
    key = f"paradecode_lab_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, LAB / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
