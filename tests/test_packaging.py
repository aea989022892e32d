"""The wheel holds every module of every subpackage under `paradecode.*`, and the console scripts."""

import importlib
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO

SUBPACKAGES = {
    "graphs": "paradecode/graphs",
    "export": "paradecode/export",
    "runtime": "paradecode/runtime",
    "tools": "paradecode/tools",
}
SCRIPTS = (
    "paradecode-export",
    "paradecode-generate",
    "paradecode-train-heads",
    "paradecode-bench",
    "paradecode-profile",
    "paradecode-characterise",
    "paradecode-demo",
    "paradecode-footprint",
    "paradecode-serve",
    "paradecode-loadtest",
)


@pytest.mark.slow
def test_wheel_contains_every_module(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("paradecode-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, package in SUBPACKAGES.items():
        for source in (REPO / folder).rglob("*.py"):
            # tools/results/ holds measurements and the scripts that made them, tools/lab/ measurement scripts: the
            # repository's, not the wheel's
            outside = any(source.is_relative_to(REPO / "tools" / kept) for kept in ("results", "lab"))
            if "__pycache__" not in source.parts and not outside:
                expected = f"{package}/{source.relative_to(REPO / folder).as_posix()}"
                if expected not in names:
                    missing.append(expected)
    assert not missing, f"modules missing from the wheel (list their package in pyproject.toml): {missing}"
    assert not [n for n in names if n.startswith(("paradecode/tools/lab/", "paradecode/tools/results/"))]
    assert not [n for n in names if n.split("/")[0] in ("export", "runtime", "graphs", "tools", "tests")], (
        "the wheel installs a top-level module named after a repository folder"
    )
    demo = {n for n in names if n.startswith("paradecode/tools/demo_model/")}
    for name in ("config.json", "model.safetensors", "heads.safetensors", "tokenizer.json", "README.md"):
        assert f"paradecode/tools/demo_model/{name}" in demo, f"{name} of the demo model is missing from the wheel"
    for name in ("heads.safetensors", "README.md"):
        assert f"paradecode/tools/models/smollm2/{name}" in names, f"SmolLM2's {name} is missing from the wheel"
    for name in ("eval_chat.jsonl", "heads_chat.jsonl", "README.md"):
        assert f"paradecode/export/data/{name}" in names, f"the prompt set file {name} is missing from the wheel"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    targets = dict(line.split(" = ") for line in text.splitlines() if " = " in line)
    for script in SCRIPTS:
        module, _, function = targets[script].partition(":")
        assert module.startswith("paradecode.") and f"{module.replace('.', '/')}.py" in names, targets[script]
        assert callable(getattr(importlib.import_module(module), function)), f"{script}: {targets[script]}"
