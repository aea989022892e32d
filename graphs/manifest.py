"""The versioned manifest: what an export folder holds and how its parts fit together.

`manifest.json` records the model's identity and spec, the export settings (dtype, limits, exit
layers, head kind, default thresholds), every subgraph with its tensor contract and files, and
the sha256 of every file in the folder. Readers refuse a manifest of another major format version
with a message that says how to re-export.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import ManifestError
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import SubgraphIO, TensorSpec

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
WEIGHTS_NAME = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
HEAD_KINDS = ("identity", "trained")
NEVER_EXIT = math.inf  # no token ever exits (the overhead test of DESIGN.md §3); stored as null in JSON


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Subgraph:
    """One subgraph of an export: its tensor contract and the files that implement it."""

    io: SubgraphIO
    onnx: str
    engine: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.io.name,
            "kind": self.io.kind,
            "layer": self.io.layer,
            "onnx": self.onnx,
            "engine": self.engine,
            "inputs": [t.to_dict() for t in self.io.inputs],
            "outputs": [t.to_dict() for t in self.io.outputs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Subgraph:
        io = SubgraphIO(
            data["name"],
            data["kind"],
            data["layer"],
            tuple(TensorSpec.from_dict(t) for t in data["inputs"]),
            tuple(TensorSpec.from_dict(t) for t in data["outputs"]),
        )
        return cls(io, data["onnx"], data.get("engine"))


@dataclass(frozen=True)
class Manifest:
    model: dict[str, Any]
    spec: ModelSpec
    dtype: str
    max_seq_len: int
    max_batch: int
    max_unverified: int
    opset: int
    exit_layers: tuple[int, ...]
    head_kind: str
    thresholds: dict[int, float]
    subgraphs: tuple[Subgraph, ...]
    files: dict[str, str] = field(default_factory=dict)
    tokenizer: tuple[str, ...] = ()
    weights: str = WEIGHTS_NAME
    tensorrt: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None
    paradecode_version: str = "unknown"
    format_version: int = FORMAT_VERSION

    def subgraph(self, name: str) -> Subgraph:
        for sub in self.subgraphs:
            if sub.io.name == name:
                return sub
        raise ManifestError(f"the manifest has no subgraph {name!r}; it has {[s.io.name for s in self.subgraphs]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "paradecode_version": self.paradecode_version,
            "model": self.model,
            "spec": self.spec.to_dict(),
            "dtype": self.dtype,
            "limits": {
                "max_seq_len": self.max_seq_len,
                "max_batch": self.max_batch,
                "max_unverified": self.max_unverified,
            },
            "opset": self.opset,
            "exit_layers": list(self.exit_layers),
            "head_kind": self.head_kind,
            "thresholds": {str(k): (None if v == NEVER_EXIT else v) for k, v in sorted(self.thresholds.items())},
            "calibration": self.calibration,
            "subgraphs": [s.to_dict() for s in self.subgraphs],
            "weights": self.weights,
            "tokenizer": list(self.tokenizer),
            "tensorrt": self.tensorrt,
            "files": dict(sorted(self.files.items())),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        limits = data["limits"]
        return cls(
            model=data["model"],
            spec=ModelSpec.from_dict(data["spec"]),
            dtype=data["dtype"],
            max_seq_len=limits["max_seq_len"],
            max_batch=limits["max_batch"],
            max_unverified=limits["max_unverified"],
            opset=data["opset"],
            exit_layers=tuple(data["exit_layers"]),
            head_kind=data["head_kind"],
            thresholds={int(k): (NEVER_EXIT if v is None else float(v)) for k, v in data["thresholds"].items()},
            subgraphs=tuple(Subgraph.from_dict(s) for s in data["subgraphs"]),
            files=dict(data.get("files", {})),
            tokenizer=tuple(data.get("tokenizer", ())),
            weights=data.get("weights", WEIGHTS_NAME),
            tensorrt=data.get("tensorrt"),
            calibration=data.get("calibration"),
            paradecode_version=data.get("paradecode_version", "unknown"),
            format_version=data["format_version"],
        )

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def read_manifest(folder: str | Path) -> Manifest:
    """Read and check `folder/manifest.json`; refuse other format versions with the fix."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{folder} is not a paradecode export: it has no {MANIFEST_NAME}. "
            "Create one with `paradecode-export MODEL -o DIR`."
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path} is not valid JSON ({err}); re-export the model.") from err
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{path} has manifest format version {version!r}; this paradecode reads version "
            f"{FORMAT_VERSION}. Re-export the model with this version: `paradecode-export MODEL -o DIR --force`."
        )
    try:
        return Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError) as err:
        raise ManifestError(
            f"{path} is incomplete or malformed ({type(err).__name__}: {err}); re-export the model."
        ) from err


def verify_files(folder: str | Path, manifest: Manifest) -> None:
    """Check that every file the manifest lists exists and has its recorded sha256."""
    folder = Path(folder)
    missing = [name for name in manifest.files if not (folder / name).is_file()]
    if missing:
        raise ManifestError(f"{folder} is missing files the manifest lists: {missing}. Re-export the model.")
    for name, digest in manifest.files.items():
        actual = sha256_of(folder / name)
        if actual != digest:
            raise ManifestError(
                f"{folder / name} is corrupt: sha256 {actual[:16]}... does not match the manifest's "
                f"{digest[:16]}.... Re-export the model."
            )
