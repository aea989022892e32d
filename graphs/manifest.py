"""The versioned manifest: what an export folder holds and how its parts fit together.

`manifest.json` records the model's identity and spec, the export settings (dtype, limits, exit
layers, head kind, default thresholds), every subgraph with its tensor contract and files, and
the sha256 and size of every file in the folder. Readers refuse a manifest of another format
version with a message that says how to re-export.

A manifest is untrusted input (docs/design.md §7): reading one checks every field's type, checks the
subgraphs against the contract `graphs.tensors.export_plan` gives for the recorded settings, checks
that each subgraph's files are at their canonical paths, and that every path it names is a
relative path listed in `files` (so every file the runtime opens is hash-checked). Errors name the
field, what arrived and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import ManifestError, UnsupportedModelError
from paradecode.graphs.quantization_manifest import Quantization, canonical_shape
from paradecode.graphs.spec import ModelSpec
from paradecode.graphs.tensors import BATCH, DTYPES, KINDS, LOGITS, SLOTS, TOKENS, SubgraphIO, TensorSpec, export_plan
from paradecode.graphs.untrusted import (
    REEXPORT,
    FileRecord,
    check_files,
    check_relative,
    json_array,
    json_field,
    json_integer,
    json_number,
    json_object,
    json_string,
    read_bounded,
    resolve_inside,
    sha256_of,
    show,
)

__all__ = [
    "FORMAT_VERSION",
    "HEAD_KINDS",
    "MANIFEST_NAME",
    "NEVER_EXIT",
    "TOKENIZER_DIR",
    "WEIGHTS_NAME",
    "FileRecord",
    "Manifest",
    "Subgraph",
    "engine_path",
    "onnx_path",
    "read_manifest",
    "sha256_of",
    "verify_files",
]

MANIFEST_NAME = "manifest.json"
# 2: files record {"sha256", "bytes"}; the structure is checked against the contract. 3: quantized weights
# (`quantization`). 4: one attention of standard operators over a cache of any number of slots up to max_seq_len
# (graphs/tensors.py), which takes several rows of several positions in one call; earlier exports' graphs
# (onnxruntime's GroupQueryAttention over a fixed cache) are re-exported.
FORMAT_VERSION = 4
READABLE_VERSIONS = (4,)
MAX_MANIFEST_BYTES = 16 << 20  # a manifest of a 100-layer model is well under 1 MiB
WEIGHTS_NAME = "onnx/weights.safetensors"  # beside the graphs: their external data points into it
TOKENIZER_DIR = "tokenizer"
HEAD_KINDS = ("identity", "trained")
OPS = ("fused", "portable")
NAMES_SHOWN = 400  # characters of a list of subgraph names in an error message (a model's list can run to thousands)
NEVER_EXIT = math.inf  # no token ever exits (the overhead test of docs/design.md §3); stored as null in JSON


def onnx_path(name: str) -> str:
    """Where an export keeps subgraph `name`'s ONNX graph."""
    return f"onnx/{name}.onnx"


def engine_path(name: str) -> str:
    """Where an export keeps subgraph `name`'s TensorRT engine."""
    return f"engines/{name}.engine"


# --- typed reading of the parts ---------------------------------------------------------------


# ModelSpec's fields that may be null, by the type of their value otherwise.
OPTIONAL_NUMBERS = ("attention_scale", "embed_scale", "final_logit_softcap")
OPTIONAL_INTEGERS = ("rotary_dim", "rope_max_positions")


def _flags(item: Any, where: str) -> None:
    for i, flag in enumerate(json_array(item, where)):
        if not isinstance(flag, bool):
            raise ManifestError(f"{where}[{i}] is {show(flag)}; expected true or false.")


def _spec(value: Any) -> ModelSpec:
    data = json_object(value, "spec")
    for f in dataclasses.fields(ModelSpec):
        if f.name not in data:
            continue
        item, where = data[f.name], f"spec.{f.name}"
        if f.name == "sliding_windows":
            for i, w in enumerate(json_array(item, where)):
                if w is not None:
                    json_integer(w, f"{where}[{i}]")
        elif f.name == "local_rope":
            _flags(item, where)
        elif f.name in OPTIONAL_NUMBERS:
            if item is not None:
                json_number(item, where)
        elif f.name in OPTIONAL_INTEGERS:
            if item is not None:
                json_integer(item, where)
        elif isinstance(f.default, bool):
            if not isinstance(item, bool):
                raise ManifestError(f"{where} is {show(item)}; expected true or false.")
        elif isinstance(f.default, float):
            json_number(item, where)
        elif isinstance(f.default, str) or f.name == "family":
            json_string(item, where)
        else:
            json_integer(item, where)
    try:
        return ModelSpec.from_dict(data)
    except (UnsupportedModelError, TypeError) as err:
        raise ManifestError(f"spec: {err}") from err


def _tensor(value: Any, where: str) -> TensorSpec:
    data = json_object(value, where)
    shape = json_array(json_field(data, "shape", f"{where}."), f"{where}.shape")
    for i, dim in enumerate(shape):
        if not isinstance(dim, str):
            json_integer(dim, f"{where}.shape[{i}]")
        elif dim not in (BATCH, TOKENS, SLOTS):
            raise ManifestError(
                f"{where}.shape[{i}] is {show(dim)}; expected an integer, {BATCH!r}, {TOKENS!r} or {SLOTS!r}."
            )
    return TensorSpec(
        json_string(json_field(data, "name", f"{where}."), f"{where}.name"),
        tuple(shape),
        json_string(json_field(data, "dtype", f"{where}."), f"{where}.dtype"),
    )


# --- the manifest -----------------------------------------------------------------------------


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
            "last": self.io.last,
            "onnx": self.onnx,
            "engine": self.engine,
            "inputs": [t.to_dict() for t in self.io.inputs],
            "outputs": [t.to_dict() for t in self.io.outputs],
        }

    @classmethod
    def from_dict(cls, value: Any, where: str = "subgraph") -> Subgraph:
        data = json_object(value, where)
        layer = json_field(data, "layer", f"{where}.")
        last = data.get("last")
        engine = data.get("engine")
        io = SubgraphIO(
            json_string(json_field(data, "name", f"{where}."), f"{where}.name"),
            json_string(json_field(data, "kind", f"{where}."), f"{where}.kind", KINDS),
            None if layer is None else json_integer(layer, f"{where}.layer"),
            tuple(
                _tensor(t, f"{where}.inputs[{i}]")
                for i, t in enumerate(json_array(json_field(data, "inputs", f"{where}."), f"{where}.inputs"))
            ),
            tuple(
                _tensor(t, f"{where}.outputs[{i}]")
                for i, t in enumerate(json_array(json_field(data, "outputs", f"{where}."), f"{where}.outputs"))
            ),
            None if last is None else json_integer(last, f"{where}.last"),
        )
        onnx = check_relative(json_field(data, "onnx", f"{where}."), f"{where}.onnx")
        return cls(io, onnx, None if engine is None else check_relative(engine, f"{where}.engine"))


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
    files: dict[str, FileRecord] = field(default_factory=dict)
    tokenizer: tuple[str, ...] = ()
    weights: str = WEIGHTS_NAME
    tensorrt: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None
    head_vocab: int | None = None  # the trained exit heads' reduced vocabulary size; None: the whole vocabulary
    # the draft head (export/draft_head.py): {"vocab": its vocabulary's size, "trained": bool, "base_weights_sha256":
    # the model it was made for, and for one reading three layers' outputs "feature_layers": [low, middle] (its
    # `draft_reduce` graph's inputs beside the last layer's)}; None: the export has none
    draft: dict[str, Any] | None = None
    quantization: Quantization | None = None  # the weights stored quantized; None: every weight in `dtype`
    ops: str = "portable"  # "fused": onnxruntime's fused norms and rotary; "portable": operators TensorRT reads too
    paradecode_version: str = "unknown"
    format_version: int = FORMAT_VERSION

    def subgraph(self, name: str) -> Subgraph:
        for sub in self.subgraphs:
            if sub.io.name == name:
                return sub
        raise ManifestError(f"the manifest has no subgraph {name!r}; it has {[s.io.name for s in self.subgraphs]}")

    @property
    def with_logits(self) -> bool:
        """Whether the heads also output full logits (the final head's outputs say)."""
        return any(s.io.kind == "final" and LOGITS in s.io.output_names for s in self.subgraphs)

    @property
    def fused_exits(self) -> bool:
        """Whether the export has fused layer + exit head graphs (`layer_exit_e`)."""
        return any(s.io.kind == "layer_exit" for s in self.subgraphs)

    @property
    def segments(self) -> bool:
        """Whether the export has segment graphs (layers between its exit layers in one call each)."""
        return any(s.io.kind == "segment" for s in self.subgraphs)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The low and middle layers whose outputs the draft head reads beside the last one's; () for none."""
        return tuple((self.draft or {}).get("feature_layers", ()))

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
            "head_vocab": self.head_vocab,
            "thresholds": {str(k): (None if v == NEVER_EXIT else v) for k, v in sorted(self.thresholds.items())},
            "calibration": self.calibration,
            "draft": self.draft,
            "subgraphs": [s.to_dict() for s in self.subgraphs],
            "weights": self.weights,
            "tokenizer": list(self.tokenizer),
            "tensorrt": self.tensorrt,
            "quantization": None if self.quantization is None else self.quantization.to_dict(),
            "ops": self.ops,
            "files": {name: record.to_dict() for name, record in sorted(self.files.items())},
        }

    @classmethod
    def from_dict(cls, value: Any) -> Manifest:
        """Read a manifest's JSON object, checking every field's type and the whole against the contract."""
        data = json_object(value, "the manifest")
        limits = json_object(json_field(data, "limits", ""), "limits")
        model = json_object(json_field(data, "model", ""), "model")
        spec = _spec(json_field(data, "spec", ""))
        exit_layers = tuple(
            json_integer(e, f"exit_layers[{i}]")
            for i, e in enumerate(json_array(json_field(data, "exit_layers", ""), "exit_layers"))
        )
        manifest = cls(
            model=model,
            spec=spec,
            dtype=json_string(json_field(data, "dtype", ""), "dtype", DTYPES),
            max_seq_len=json_integer(json_field(limits, "max_seq_len", "limits."), "limits.max_seq_len"),
            max_batch=json_integer(json_field(limits, "max_batch", "limits."), "limits.max_batch"),
            max_unverified=json_integer(json_field(limits, "max_unverified", "limits."), "limits.max_unverified"),
            opset=json_integer(json_field(data, "opset", ""), "opset"),
            exit_layers=exit_layers,
            head_kind=json_string(json_field(data, "head_kind", ""), "head_kind", HEAD_KINDS),
            head_vocab=None
            if data.get("head_vocab") is None
            else json_integer(data["head_vocab"], "head_vocab", minimum=2),
            thresholds=_thresholds(json_field(data, "thresholds", "")),
            subgraphs=tuple(
                Subgraph.from_dict(s, f"subgraphs[{i}]")
                for i, s in enumerate(json_array(json_field(data, "subgraphs", ""), "subgraphs"))
            ),
            files={
                check_relative(name, "a files key"): FileRecord.from_dict(record, f"files[{name!r}]")
                for name, record in json_object(json_field(data, "files", ""), "files").items()
            },
            tokenizer=tuple(
                check_relative(p, f"tokenizer[{i}]")
                for i, p in enumerate(json_array(data.get("tokenizer", []), "tokenizer"))
            ),
            weights=check_relative(data.get("weights", WEIGHTS_NAME), "weights"),
            tensorrt=_tensorrt(data.get("tensorrt")),
            quantization=None if data.get("quantization") is None else Quantization.from_dict(data["quantization"]),
            ops=json_string(data.get("ops", "portable"), "ops", OPS),
            calibration=None if data.get("calibration") is None else json_object(data["calibration"], "calibration"),
            draft=_draft(data.get("draft"), spec),
            paradecode_version=json_string(data.get("paradecode_version", "unknown"), "paradecode_version"),
            format_version=json_integer(json_field(data, "format_version", ""), "format_version"),
        )
        manifest.check_contract()
        return manifest

    def check_contract(self) -> None:
        """Check the settings, the subgraph list and the named files against the contract (docs/design.md §4)."""
        spec, last = self.spec, self.spec.num_layers
        if self.max_seq_len > spec.max_position_embeddings:
            raise ManifestError(
                f"limits.max_seq_len is {self.max_seq_len}; expected at most the model's "
                f"max_position_embeddings ({spec.max_position_embeddings}, from spec)."
            )
        if spec.rope_max_positions is not None and self.max_seq_len > spec.rope_max_positions:
            raise ManifestError(
                f"limits.max_seq_len is {self.max_seq_len}; expected at most the positions its rotary tables hold "
                f"exactly ({spec.rope_max_positions}, spec.rope_max_positions)."
            )
        if not self.exit_layers or list(self.exit_layers) != sorted(set(self.exit_layers)):
            raise ManifestError(
                f"exit_layers is {list(self.exit_layers)}; expected distinct layers in increasing order, at least one."
            )
        outside = [e for e in self.exit_layers if not 1 <= e < last]
        if outside:
            raise ManifestError(
                f"exit_layers has {outside}, outside 1..{last - 1}: an exit head sits after a layer below the "
                f"last of the model's {last} layers."
            )
        if set(self.thresholds) != set(self.exit_layers):
            raise ManifestError(
                f"thresholds has layers {sorted(self.thresholds)}; expected one per exit layer "
                f"{list(self.exit_layers)}."
            )
        eos = self.model.get("eos_token_id")
        if isinstance(eos, list):
            for i, token in enumerate(eos):
                json_integer(token, f"model.eos_token_id[{i}]", minimum=0)
        elif eos is not None:
            json_integer(eos, "model.eos_token_id", minimum=0)
        self._check_subgraphs()
        self._check_named_files()
        self._check_quantization()

    def _check_quantization(self) -> None:
        if self.quantization is None:
            return
        if self.dtype != "float32":
            raise ManifestError(f"quantization is set and dtype is {show(self.dtype)}; quantized exports are float32.")
        for name, fmt in sorted(self.quantization.weights.items()):
            shape = canonical_shape(self.spec, name, self.head_vocab)
            if shape is None:
                raise ManifestError(f"quantization.weights names {show(name)}, which this model does not have.")
            if fmt.shape != shape:
                raise ManifestError(
                    f"quantization.weights.{name}.shape is {list(fmt.shape)}; the spec gives {list(shape)}."
                )

    def _check_subgraphs(self) -> None:
        # The contract has a graph per layer besides the embedding and the final head: a spec with more layers than
        # that is refused before the plan is built (10**9 layers would take the plan minutes and gigabytes).
        layers, listed_count = self.spec.num_layers, len(self.subgraphs)
        if layers + 2 > listed_count:
            raise ManifestError(
                f"spec.num_layers is {layers}, but subgraphs lists {listed_count} graphs: an export holds one graph "
                f"per layer besides its embedding and final head, so at most {max(listed_count - 2, 0)} layers."
            )
        settings = dict(
            dtype=self.dtype,
            max_seq_len=self.max_seq_len,
            max_batch=self.max_batch,
            with_logits=self.with_logits,
            exit_heads=self.head_kind == "trained",
            head_vocab=self.head_vocab,
            fused_exits=self.fused_exits,
            segments=self.segments,
            draft=self.draft is not None,
            feature_layers=self.feature_layers,
        )
        plan = export_plan(self.spec, self.exit_layers, **settings)
        contract = (
            f"the contract for {self.spec.num_layers} layers, exit layers {list(self.exit_layers)}, "
            + ", ".join(f"{k} {v}" for k, v in settings.items())
        )
        expected, listed = [io.name for io in plan], [s.io.name for s in self.subgraphs]
        if listed != expected:
            known, given = set(expected), set(listed)
            missing = [n for n in expected if n not in given]
            unexpected = [n for n in listed if n not in known]
            repeated = sorted(n for n, count in Counter(listed).items() if count > 1)
            if missing or unexpected:
                detail = f"missing {show(missing, NAMES_SHOWN)}, unexpected {show(unexpected, NAMES_SHOWN)}"
            else:
                detail = f"repeated {show(repeated, NAMES_SHOWN)}" if repeated else "in another order"
            raise ManifestError(
                f"subgraphs lists {show(listed, NAMES_SHOWN)}; {contract} has {show(expected, NAMES_SHOWN)} ({detail})."
            )
        for i, (io, sub) in enumerate(zip(plan, self.subgraphs)):
            where = f"subgraphs[{i}] ({io.name})"
            difference = _difference(io, sub.io)
            if difference:
                raise ManifestError(f"{where}: {difference}; {contract}.")
            if sub.onnx != onnx_path(io.name):
                raise ManifestError(f"{where}.onnx is {show(sub.onnx)}; expected {onnx_path(io.name)!r}.")
            if sub.engine is not None and sub.engine != engine_path(io.name):
                raise ManifestError(f"{where}.engine is {show(sub.engine)}; expected {engine_path(io.name)!r}.")

    def _check_named_files(self) -> None:
        named = [("weights", self.weights)]
        named += [(f"tokenizer[{i}]", p) for i, p in enumerate(self.tokenizer)]
        for i, sub in enumerate(self.subgraphs):
            named.append((f"subgraphs[{i}].onnx", sub.onnx))
            if sub.engine is not None:
                named.append((f"subgraphs[{i}].engine", sub.engine))
        for where, path in named:
            if where.startswith("tokenizer") and not path.startswith(f"{TOKENIZER_DIR}/"):
                raise ManifestError(f"{where} is {show(path)}; expected a file in {TOKENIZER_DIR}/.")
            if path not in self.files:
                raise ManifestError(
                    f"{where} is {show(path)}, which files does not list: every file the runtime opens must have "
                    "its sha256 and size in files."
                )

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def _thresholds(value: Any) -> dict[int, float]:
    thresholds = {}
    for key, item in json_object(value, "thresholds").items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ManifestError(f"thresholds has the key {show(key)}; expected exit layer numbers.")
        if item is None:
            thresholds[int(key)] = NEVER_EXIT
            continue
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0.0 <= item <= 1.0:
            raise ManifestError(f"thresholds[{key!r}] is {show(item)}; expected a number in [0, 1] or null (never).")
        thresholds[int(key)] = float(item)
    return thresholds


def _draft(value: Any, spec: ModelSpec) -> dict[str, Any] | None:
    """The draft head's record: its vocabulary's size within the model's, whether it was trained."""
    if value is None:
        return None
    draft = json_object(value, "draft")
    vocab = json_integer(json_field(draft, "vocab", "draft."), "draft.vocab", minimum=2)
    if vocab > spec.vocab_size:
        raise ManifestError(f"draft.vocab is {vocab}; expected at most the model's vocabulary ({spec.vocab_size}).")
    if not isinstance(draft.get("trained"), bool):
        raise ManifestError(f"draft.trained is {show(draft.get('trained'))}; expected true or false.")
    if "feature_layers" in draft:
        layers = json_array(draft["feature_layers"], "draft.feature_layers")
        last = spec.num_layers - 1
        if len(layers) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= last for x in layers):
            raise ManifestError(
                f"draft.feature_layers is {show(layers)}; expected the two layers (each in 1..{last}) whose outputs "
                "the draft head reads beside the last one's."
            )
    return draft


def _tensorrt(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    data = json_object(value, "tensorrt")
    json_string(json_field(data, "version", "tensorrt."), "tensorrt.version")
    json_string(json_field(data, "gpu", "tensorrt."), "tensorrt.gpu")
    for i, item in enumerate(json_array(json_field(data, "token_ranges", "tensorrt."), "tensorrt.token_ranges")):
        where = f"tensorrt.token_ranges[{i}]"
        bounds = [json_integer(b, f"{where}[{j}]") for j, b in enumerate(json_array(item, where))]
        if len(bounds) != 3 or not bounds[0] <= bounds[1] <= bounds[2]:
            raise ManifestError(f"{where} is {show(item)}; expected [min, opt, max] with min <= opt <= max.")
    return data


def _difference(expected: SubgraphIO, actual: SubgraphIO) -> str | None:
    """The first way `actual` differs from the contract `expected`, in words; None if it does not."""
    for attr in ("kind", "layer", "last"):
        if getattr(actual, attr) != getattr(expected, attr):
            return f"{attr} is {show(getattr(actual, attr))}, the contract has {getattr(expected, attr)!r}"
    for side in ("inputs", "outputs"):
        ours, theirs = getattr(expected, side), getattr(actual, side)
        if [t.name for t in theirs] != [t.name for t in ours]:
            return f"{side} are {[t.name for t in theirs]}, the contract has {[t.name for t in ours]}"
        for want, got in zip(ours, theirs):
            if got.shape != want.shape:
                return f"{side[:-1]} {got.name} has shape {list(got.shape)}, the contract has {list(want.shape)}"
            if got.dtype != want.dtype:
                return f"{side[:-1]} {got.name} has dtype {show(got.dtype)}, the contract has {want.dtype!r}"
    return None


# --- reading an export folder's manifest and files --------------------------------------------


def read_manifest(folder: str | Path) -> Manifest:
    """Read and check `folder/manifest.json`; refuse other format versions with the fix."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{folder} is not a paradecode export: it has no {MANIFEST_NAME}. "
            "Create one with `paradecode-export MODEL -o DIR`."
        )
    raw = read_bounded(resolve_inside(folder.resolve(), MANIFEST_NAME, MANIFEST_NAME), str(path), MAX_MANIFEST_BYTES)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ManifestError(f"{path} is not valid JSON ({type(err).__name__}: {err}). {REEXPORT}") from err
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in READABLE_VERSIONS:
        why = " (version 1 records no file sizes, which are needed to check files safely)" if version == 1 else ""
        raise ManifestError(
            f"{path} has manifest format version {show(version)}; this paradecode reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}{why}. Re-export the model with this version: "
            "`paradecode-export MODEL -o DIR --force`."
        )
    try:
        return Manifest.from_dict(data)
    except ManifestError as err:
        raise ManifestError(
            f"{path} does not describe a valid export: {err} It was not written by this paradecode or was "
            f"modified since. {REEXPORT}"
        ) from err


def verify_files(folder: str | Path, manifest: Manifest, *, hashed: bool = True) -> None:
    """Check that every file the manifest lists is inside `folder`, a regular file of its recorded
    size and, with `hashed`, of its recorded sha256 (reading at most its size plus one block)."""
    check_files(Path(folder), manifest.files, hashed=hashed)
