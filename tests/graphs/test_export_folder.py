"""An export folder is untrusted input (docs/design.md §7): paths stay inside, files are listed and
hash-checked with bounded reads, and the manifest's structure matches the subgraph contract.

Every refusal is a ManifestError whose message names the field and the path or value, and never
prints a file's actual sha256 (no foreign file's hash leaks through an error).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from paradecode.graphs import untrusted
from paradecode.graphs.errors import ManifestError
from paradecode.graphs.manifest import FORMAT_VERSION, MAX_MANIFEST_BYTES, FileRecord
from paradecode.runtime import load
from paradecode.runtime.loader import open_export

HUGE = 10 << 30  # a 10 GiB sparse file: hashing it would take far longer than the tests' timeout

WEIGHTS = "onnx/weights.safetensors"


@pytest.fixture
def folder(exports, tmp_path) -> Path:
    """A private copy of the tiny llama export (4 layers, exit layers 1-3, fused exits, logits)."""
    source, _ = exports["llama"]
    copy = tmp_path / "export"
    shutil.copytree(source, copy)
    return copy


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(path: Path) -> dict:
    return {"sha256": sha256(path), "bytes": path.stat().st_size}


def outside(folder: Path, name: str, data: bytes = b"a file outside the export\n") -> Path:
    path = folder.parent / "outside" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def sparse(path: Path, size: int = HUGE) -> Path:
    with open(path, "ab") as f:
        f.truncate(size)
    return path


def subgraph(data: dict, name: str) -> dict:
    return next(s for s in data["subgraphs"] if s["name"] == name)


def tensor(entries: list, name: str) -> dict:
    return next(t for t in entries if t["name"] == name)


def rewrite(folder: Path, change: Callable[[dict], object]) -> None:
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def assert_no_hash_leak(message: str, foreign: list[Path]) -> None:
    assert not re.search(r"[0-9a-f]{16}", message), f"a hash-like string in the message: {message}"
    for path in foreign:
        assert sha256(path)[:8] not in message, f"the sha256 of {path} leaks into: {message}"


def refused(folder: Path, pattern: str, foreign: list[Path] = (), **options) -> str:
    with pytest.raises(ManifestError, match=pattern) as info:
        open_export(folder, **options)
    message = str(info.value)
    assert_no_hash_leak(message, list(foreign))
    return message


@pytest.fixture
def hashed_bytes(monkeypatch) -> list[int]:
    """Counts every byte the export checks hash (one entry per file)."""
    counts: list[int] = []

    class Counting:
        def __init__(self):
            self.digest = hashlib.sha256()
            counts.append(0)
            self.index = len(counts) - 1

        def update(self, block):
            counts[self.index] += len(block)
            self.digest.update(block)

        def hexdigest(self):
            return self.digest.hexdigest()

    monkeypatch.setattr(untrusted, "hashlib", types.SimpleNamespace(sha256=Counting))
    return counts


# --- the happy path ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_export_records_each_files_size_and_opens_through_checked_paths(folder):
    data = json.loads((folder / "manifest.json").read_text())
    assert data["format_version"] == FORMAT_VERSION == 4
    for name, entry in data["files"].items():
        assert entry == record(folder / name), name
    export = open_export(folder)
    assert all(isinstance(r, FileRecord) for r in export.manifest.files.values())
    for sub in export.manifest.subgraphs:
        assert export.file(sub.onnx) == (folder / f"onnx/{sub.io.name}.onnx").resolve()
    assert export.file(WEIGHTS) == (folder / WEIGHTS).resolve()


@pytest.mark.timeout(60)
def test_a_symlink_that_stays_inside_the_folder_is_followed(folder):
    blobs = folder / "blobs"
    blobs.mkdir()
    (folder / WEIGHTS).rename(blobs / "weights.bin")
    (folder / WEIGHTS).symlink_to(Path("..") / "blobs" / "weights.bin")
    with load(folder, backend="torch") as model:
        assert model.export.file(WEIGHTS) == (blobs / "weights.bin").resolve()
        result = model.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, ignore_eos=True)
    assert len(result.token_ids) == 3


# --- tampered manifests, table-driven ---------------------------------------------------------


def absolute_onnx(data, folder):
    target = outside(folder, "layer_1.onnx", (folder / "onnx" / "layer_1.onnx").read_bytes())
    subgraph(data, "layer_1")["onnx"] = str(target)
    data["files"][str(target)] = record(target)
    return [target]


def absolute_files_key(data, folder):
    target = outside(folder, "secret.txt")
    data["files"][str(target)] = record(target)
    return [target]


def windows_absolute_weights(data, folder):
    data["weights"] = "C:/exports/weights.safetensors"


def dotdot_weights(data, folder):
    target = outside(folder, "weights.safetensors", (folder / WEIGHTS).read_bytes())
    data["weights"] = "../outside/weights.safetensors"
    return [target]


def dotdot_inside_a_files_key(data, folder):
    target = outside(folder, "secret.txt")
    data["files"]["onnx/../../outside/secret.txt"] = record(target)
    return [target]


def dotdot_tokenizer(data, folder):
    target = outside(folder, "tokenizer.json", b"{}")
    data["tokenizer"] = ["tokenizer/../../outside/tokenizer.json"]
    return [target]


def path_missing_from_files(data, folder):
    del data["files"]["onnx/exit_2.onnx"]


def weights_missing_from_files(data, folder):
    del data["files"][WEIGHTS]


def tokenizer_missing_from_files(data, folder):
    data["tokenizer"] = ["tokenizer/tokenizer.json"]


def tokenizer_outside_its_folder(data, folder):
    data["tokenizer"] = ["onnx/embed.onnx"]


def layer_2_points_at_layer_3(data, folder):
    subgraph(data, "layer_2")["onnx"] = "onnx/layer_3.onnx"


def engine_of_another_subgraph(data, folder):
    subgraph(data, "layer_2")["engine"] = "onnx/layer_3.onnx"


def tampered_cache_shape(data, folder):
    tensor(subgraph(data, "layer_2")["inputs"], "past_key")["shape"][2] = 65


def float_in_a_shape(data, folder):
    tensor(subgraph(data, "layer_2")["inputs"], "past_key")["shape"][2] = 64.0


def tampered_tensor_dtype(data, folder):
    tensor(subgraph(data, "exit_1")["outputs"], "token")["dtype"] = "int32"


def tampered_export_dtype(data, folder):
    data["dtype"] = "float16"


def unknown_dtype(data, folder):
    data["dtype"] = "int4"


def zero_max_batch(data, folder):
    data["limits"]["max_batch"] = 0


def string_max_unverified(data, folder):
    data["limits"]["max_unverified"] = "5"


def max_seq_len_beyond_the_model(data, folder):
    data["limits"]["max_seq_len"] = 10**9


def subgraph_removed(data, folder):
    data["subgraphs"] = [s for s in data["subgraphs"] if s["name"] != "exit_2"]


def subgraph_added(data, folder):
    extra = dict(subgraph(data, "layer_4"), name="layer_5", layer=5, onnx="onnx/layer_5.onnx")
    data["subgraphs"].insert(-1, extra)


def subgraph_repeated(data, folder):
    data["subgraphs"].insert(2, subgraph(data, "layer_1"))


def subgraphs_reordered(data, folder):
    subs = data["subgraphs"]
    subs[1], subs[4] = subs[4], subs[1]


def layer_renumbered(data, folder):
    subgraph(data, "layer_2")["layer"] = 3


def unknown_head_kind(data, folder):
    data["head_kind"] = "oracle"


def threshold_above_one(data, folder):
    data["thresholds"]["2"] = 1.5


def threshold_not_a_number(data, folder):
    data["thresholds"]["2"] = "high"


def threshold_for_a_layer_without_an_exit(data, folder):
    data["thresholds"]["4"] = 0.5


def exit_layer_at_the_last_layer(data, folder):
    data["exit_layers"] = [1, 2, 4]


def exit_layer_zero(data, folder):
    data["exit_layers"] = [0, 1, 2]


def file_record_of_version_1(data, folder):
    data["files"][WEIGHTS] = data["files"][WEIGHTS]["sha256"]


def negative_file_size(data, folder):
    data["files"][WEIGHTS]["bytes"] = -1


def spec_field_of_the_wrong_type(data, folder):
    data["spec"]["norm_eps"] = "1e-5"


def eos_token_of_the_wrong_type(data, folder):
    data["model"]["eos_token_id"] = ["two"]


def local_rope_of_the_wrong_type(data, folder):
    data["spec"]["local_rope"] = [True, "no", False, True]


def odd_rotary_dim(data, folder):
    data["spec"]["rotary_dim"] = 5


def max_seq_len_beyond_the_rotary_tables(data, folder):
    data["spec"]["rope_max_positions"] = 32


def a_billion_layers(data, folder):
    data["spec"]["num_layers"] = 10**9  # building the plan first spun for minutes, memory growing


def more_layers_than_graphs(data, folder):
    data["spec"]["num_layers"] = 10**5  # building the plan first ended in a 3 MB one-line error


TAMPERED = [
    (absolute_onnx, r"subgraphs\[1\]\.onnx is '/\S*layer_1\.onnx', an absolute path"),
    (absolute_files_key, r"a files key is '/\S*secret\.txt', an absolute path"),
    (windows_absolute_weights, r"weights is 'C:/exports/weights\.safetensors', an absolute path"),
    (dotdot_weights, r"weights is '\.\./outside/weights\.safetensors', with an empty, '\.' or '\.\.' component"),
    (dotdot_inside_a_files_key, r"a files key is 'onnx/\.\./\.\./outside/secret\.txt', with an empty, '\.' or '\.\.'"),
    (dotdot_tokenizer, r"tokenizer\[0\] is 'tokenizer/\.\./\.\./outside/tokenizer\.json', with an empty"),
    (path_missing_from_files, r"subgraphs\[5\]\.onnx is 'onnx/exit_2\.onnx', which files does not list"),
    (weights_missing_from_files, r"weights is 'onnx/weights\.safetensors', which files does not list"),
    (tokenizer_missing_from_files, r"tokenizer\[0\] is 'tokenizer/tokenizer\.json', which files does not list"),
    (tokenizer_outside_its_folder, r"tokenizer\[0\] is 'onnx/embed\.onnx'; expected a file in tokenizer/"),
    (
        layer_2_points_at_layer_3,
        r"subgraphs\[4\] \(layer_2\)\.onnx is 'onnx/layer_3\.onnx'; expected 'onnx/layer_2\.onnx'",
    ),
    (
        engine_of_another_subgraph,
        r"subgraphs\[4\] \(layer_2\)\.engine is 'onnx/layer_3\.onnx'; expected 'engines/layer_2",
    ),
    (
        tampered_cache_shape,
        r"subgraphs\[4\] \(layer_2\): input past_key has shape \['batch', 2, 65, 12\], "
        r"the contract has \['batch', 2, 'slots', 12\]; "
        r"the contract for 4 layers, exit layers \[1, 2, 3\], dtype float32, max_seq_len 64",
    ),
    (float_in_a_shape, r"subgraphs\[4\]\.inputs\[2\]\.shape\[2\] is 64\.0; expected an integer >= 1"),
    (tampered_tensor_dtype, r"subgraphs\[2\] \(exit_1\): output token has dtype 'int32', the contract has 'int64'"),
    (
        tampered_export_dtype,
        r"subgraphs\[0\] \(embed\): output hidden has dtype 'float32', the contract has 'float16'.*dtype float16",
    ),
    (unknown_dtype, r"dtype is 'int4'; expected one of \['float32', 'float16', 'bfloat16'\]"),
    (zero_max_batch, r"limits\.max_batch is 0; expected an integer >= 1"),
    (string_max_unverified, r"limits\.max_unverified is '5'; expected an integer >= 1"),
    (max_seq_len_beyond_the_model, r"limits\.max_seq_len is 1000000000; expected at most the model's max_position"),
    (subgraph_removed, r"subgraphs lists \[.*\]; the contract .* \(missing \['exit_2'\], unexpected \[\]\)"),
    (subgraph_added, r"subgraphs lists .* \(missing \[\], unexpected \['layer_5'\]\)"),
    (subgraph_repeated, r"subgraphs lists \['embed', 'layer_1', 'layer_1', .* \(repeated \['layer_1'\]\)"),
    (subgraphs_reordered, r"subgraphs lists \['embed', 'layer_2', .*\(in another order\)"),
    (layer_renumbered, r"subgraphs\[4\] \(layer_2\): layer is 3, the contract has 2"),
    (unknown_head_kind, r"head_kind is 'oracle'; expected one of \['identity', 'trained'\]"),
    (threshold_above_one, r"thresholds\['2'\] is 1\.5; expected a number in \[0, 1\] or null"),
    (threshold_not_a_number, r"thresholds\['2'\] is 'high'; expected a number in \[0, 1\] or null"),
    (
        threshold_for_a_layer_without_an_exit,
        r"thresholds has layers \[1, 2, 3, 4\]; expected one per exit layer \[1, 2, 3\]",
    ),
    (exit_layer_at_the_last_layer, r"exit_layers has \[4\], outside 1\.\.3"),
    (exit_layer_zero, r"exit_layers\[0\] is 0; expected an integer >= 1"),
    (
        file_record_of_version_1,
        r"files\['onnx/weights\.safetensors'\] is a str; expected \{'sha256': HEX, 'bytes': N\}",
    ),
    (negative_file_size, r"files\['onnx/weights\.safetensors'\]\.bytes is -1; expected an integer >= 0"),
    (spec_field_of_the_wrong_type, r"spec\.norm_eps is '1e-5'; expected a finite number"),
    (eos_token_of_the_wrong_type, r"model\.eos_token_id\[0\] is 'two'; expected an integer >= 0"),
    (local_rope_of_the_wrong_type, r"spec\.local_rope\[1\] is 'no'; expected true or false"),
    (odd_rotary_dim, r"spec: ModelSpec\.rotary_dim must be an even number of dims from 2 to head_dim \(12\)"),
    (max_seq_len_beyond_the_rotary_tables, r"limits\.max_seq_len is 64; expected at most .* \(32, spec\.rope_max"),
    (a_billion_layers, r"spec\.num_layers is 1000000000, but subgraphs lists 13 graphs: .* at most 11 layers\. It"),
    (more_layers_than_graphs, r"spec\.num_layers is 100000, but subgraphs lists 13 graphs"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("tamper", "pattern"), TAMPERED, ids=[t.__name__ for t, _ in TAMPERED])
def test_a_tampered_manifest_is_refused_naming_the_field(folder, tamper, pattern):
    foreign: list[Path] = []
    rewrite(folder, lambda data: foreign.extend(tamper(data, folder) or []))
    message = refused(folder, pattern, foreign)
    assert "manifest.json does not describe a valid export" in message and "paradecode-export" in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layers", [10**5, 10**9])
def test_a_spec_with_more_layers_than_graphs_is_refused_at_once_in_a_short_message(folder, layers):
    """Regression: the contract's plan was built before its size was checked (10**9 layers spun, 10**5 layers gave a
    3 MB message); a listing that is not the contract's is shown shortened too."""
    rewrite(folder, lambda data: data["spec"].update(num_layers=layers))
    assert len(refused(folder, r"spec\.num_layers")) < 1000
    rewrite(folder, lambda data: data.update(subgraphs=data["subgraphs"] * 400, spec={**data["spec"], "num_layers": 4}))
    assert len(refused(folder, r"subgraphs lists \['embed', .*\.\.\.; the contract for")) < 2000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prog", ["generate", "serve"])
def test_the_commands_refuse_an_impossible_layer_count_with_exit_2_and_no_traceback(folder, prog, capsys):
    from paradecode.runtime import cli as generate_cli
    from paradecode.runtime.serve import cli as serve_cli

    rewrite(folder, lambda data: data["spec"].update(num_layers=10**9))
    if prog == "generate":
        code = generate_cli.main([str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    else:
        code = serve_cli.main([str(folder), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "spec.num_layers is 1000000000" in err and "Traceback" not in err and len(err) < 1500, err


# --- symlinks, huge files and odd files on disk -----------------------------------------------


def weights_symlink_out(folder):
    target = outside(folder, "weights.safetensors", (folder / WEIGHTS).read_bytes())
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to(target)  # same bytes, same sha256: only the place is wrong
    return (
        r"files\['onnx/weights\.safetensors'\] is 'onnx/weights\.safetensors', "
        r"which resolves through a symlink to \S*outside"
    )


def onnx_folder_symlink_out(folder):
    target = folder.parent / "outside" / "onnx"
    shutil.copytree(folder / "onnx", target)
    shutil.rmtree(folder / "onnx")
    (folder / "onnx").symlink_to(target, target_is_directory=True)
    return r"files\['onnx/\w+\.onnx'\] is 'onnx/\w+\.onnx', which resolves through a symlink to \S*outside/onnx"


def relative_symlink_out(folder):
    target = outside(folder, "weights.safetensors", (folder / WEIGHTS).read_bytes())
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to(Path("..") / ".." / "outside" / target.name)
    return r"'onnx/weights\.safetensors', which resolves through a symlink to \S*outside/weights\.safetensors: outside"


def manifest_symlink_out(folder):
    target = outside(folder, "manifest.json", (folder / "manifest.json").read_bytes())
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").symlink_to(target)
    return r"manifest\.json is 'manifest\.json', which resolves through a symlink to \S*outside/manifest\.json"


def huge_sparse_file_outside(folder):
    (folder.parent / "outside").mkdir()
    target = sparse(folder.parent / "outside" / "huge.bin")
    (folder / "huge.bin").symlink_to(target)
    rewrite(folder, lambda data: data["files"].update({"huge.bin": {"sha256": "0" * 64, "bytes": HUGE}}))
    return r"files\['huge\.bin'\] is 'huge\.bin', which resolves through a symlink to \S*outside/huge\.bin"


def huge_sparse_file_in_place_of_the_weights(folder):
    size = (folder / WEIGHTS).stat().st_size
    sparse(folder / WEIGHTS)
    return rf"export/onnx/weights\.safetensors has {HUGE} bytes, the manifest records {size}\. Re-export"


def huge_manifest(folder):
    sparse(folder / "manifest.json")
    return rf"manifest\.json has {HUGE} bytes; expected at most {MAX_MANIFEST_BYTES}"


def fifo_in_place_of_the_weights(folder):
    (folder / WEIGHTS).unlink()
    os.mkfifo(folder / WEIGHTS)  # opening it for reading would block without O_NONBLOCK
    return r"export/onnx/weights\.safetensors is not a regular file; the export lists it as a file"


def directory_in_place_of_an_onnx_file(folder):
    (folder / "onnx" / "final.onnx").unlink()
    (folder / "onnx" / "final.onnx").mkdir()
    return r"export/onnx/final\.onnx is not a regular file"


ON_DISK = [
    weights_symlink_out,
    onnx_folder_symlink_out,
    relative_symlink_out,
    manifest_symlink_out,
    huge_sparse_file_outside,
    huge_sparse_file_in_place_of_the_weights,
    huge_manifest,
    fifo_in_place_of_the_weights,
    directory_in_place_of_an_onnx_file,
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tamper", ON_DISK, ids=[t.__name__ for t in ON_DISK])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_tampered_folder_is_refused_without_reading_what_it_must_not(folder, tamper, verify, hashed_bytes):
    """Paths, sizes and file types are checked with --no-verify too (only the hashing is skipped)."""
    legit = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    pattern = tamper(folder)
    foreign = [p for p in (folder.parent / "outside").rglob("*") if p.is_file() and p.stat().st_size < HUGE]
    refused(folder, pattern, foreign, verify=verify)
    assert sum(hashed_bytes) <= legit, f"{sum(hashed_bytes)} bytes hashed: more than the export's own {legit}"
    if not verify:
        assert hashed_bytes == []


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
def test_a_max_seq_len_its_rotary_tables_do_not_cover_is_refused_at_load(folder):
    """The manifest's max_seq_len is the length of the rotary tables its graphs read (export/attention.py): a larger
    one, which the manifest alone cannot tell, is refused when the graphs load, naming both."""
    rewrite(folder, lambda data: data["limits"].update(max_seq_len=65))
    with pytest.raises(ManifestError, match=r"rope\.cos holds rotary tables of 64 positions.*max_seq_len is 65"):
        load(folder)


def test_a_version_1_manifest_asks_for_a_re_export(folder):
    def to_version_1(data):
        data["format_version"] = 1
        data["files"] = {name: entry["sha256"] for name, entry in data["files"].items()}

    rewrite(folder, to_version_1)
    refused(
        folder,
        r"manifest\.json has manifest format version 1; this paradecode reads versions 4 "
        r"\(version 1 records no file sizes, which are needed to check files safely\)\. "
        r"Re-export the model with this version: `paradecode-export MODEL -o DIR --force`",
    )


@pytest.mark.timeout(60)
def test_a_corrupt_file_is_named_without_printing_its_hash(folder, hashed_bytes):
    path = folder / "onnx" / "layer_1.onnx"
    with open(path, "r+b") as f:
        f.seek(50)
        f.write(b"\x00\x01\x02")
    message = refused(
        folder, r"onnx/layer_1\.onnx is corrupt: sha256 of its \d+ bytes does not match the manifest's sha256\.", [path]
    )
    assert "Re-export the model" in message
    assert max(hashed_bytes) <= max(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.timeout(60)
def test_a_file_listed_in_the_manifest_but_missing_is_named(folder):
    (folder / "onnx" / "exit_2.onnx").unlink()
    refused(folder, r"is missing files the manifest lists: \['onnx/exit_2\.onnx'\]")


# --- ExportFolder.file: the one way the runtime opens a file ------------------------------------


@pytest.mark.timeout(60)
def test_export_file_refuses_what_the_manifest_does_not_list_or_what_changed_since(folder):
    export = open_export(folder)
    (folder / "extra.bin").write_bytes(b"not listed")
    for relative in ("manifest.json", "extra.bin", "/etc/passwd", "../export/weights.safetensors", "onnx"):
        with pytest.raises(ManifestError, match=rf"{re.escape(repr(relative))} is not among the files the manifest"):
            export.file(relative)
    target = outside(folder, "weights.safetensors", (folder / WEIGHTS).read_bytes())
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to(target)  # swapped after the export was opened
    with pytest.raises(ManifestError, match=r"which resolves through a symlink to \S*outside") as info:
        export.file(WEIGHTS)
    assert_no_hash_leak(str(info.value), [target])
    path = folder / "onnx" / "layer_1.onnx"
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00")
    with pytest.raises(ManifestError, match=rf"layer_1\.onnx has {size + 1} bytes, the manifest records {size}"):
        export.file("onnx/layer_1.onnx")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_backends_open_files_through_the_checked_path(folder, backend):
    """A file swapped for a symlink out of the folder after opening the export is refused by the backend."""
    from paradecode.runtime.backends import backend_class

    export = open_export(folder)
    relative = "onnx/layer_2.onnx" if backend == "onnxruntime" else WEIGHTS
    target = outside(folder, Path(relative).name, (folder / relative).read_bytes())
    (folder / relative).unlink()
    (folder / relative).symlink_to(target)
    with pytest.raises(
        ManifestError, match=rf"'{re.escape(relative)}', which resolves through a symlink to \S*outside"
    ):
        backend_class(backend)(export, device="cpu")


@pytest.mark.timeout(60)
def test_a_model_whose_layer_2_points_at_layer_3_is_not_loaded(folder):
    rewrite(folder, lambda data: layer_2_points_at_layer_3(data, folder))
    with pytest.raises(
        ManifestError, match=r"\(layer_2\)\.onnx is 'onnx/layer_3\.onnx'; expected 'onnx/layer_2\.onnx'"
    ):
        load(folder)


@pytest.mark.timeout(60)
def test_each_onnx_graph_is_named_after_its_subgraph(folder):
    """What a backend can check on load (onnxruntime: session.get_modelmeta().graph_name) to catch a
    file whose content is another subgraph's even where the manifest's paths and hashes agree."""
    ort = pytest.importorskip("onnxruntime")
    export = open_export(folder)
    names = {}
    for sub in export.manifest.subgraphs:
        session = ort.InferenceSession(str(export.file(sub.onnx)), providers=["CPUExecutionProvider"])
        names[sub.io.name] = session.get_modelmeta().graph_name
    assert names == {name: name for name in names}
