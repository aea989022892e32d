"""An export changed on disk under a loaded model (runtime/watched.py): the model computes with what it loaded and
never maps a file, and once its folder holds something else it refuses requests with `export_changed`.

The server tests change the folder the ways users do: re-exporting with --force (the folder replaced by a rename)
with other weights of the same architecture or with another model, overwriting the weights in place with their
modification time restored, and truncating them while requests decode (in a subprocess: a SIGBUS kills it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from paradecode.graphs.errors import ExportChangedError, ManifestError
from tests.conftest import REPO
from tests.runtime.serve.test_serve import PROMPT
from tests.serving import NAME, free_port, sse_events, wait_until

WEIGHTS = "onnx/weights.safetensors"
BODY = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}


def replace_by_rename(folder: Path, new: Path) -> None:
    """What `paradecode-export --force` does: the new export is staged beside the folder and renamed onto it."""
    staged = folder.with_name(folder.name + ".staged")
    shutil.copytree(new, staged)
    folder.rename(folder.with_name(folder.name + ".old"))
    staged.rename(folder)


def overwrite_in_place(folder: Path, new: Path) -> None:
    """The weights written over in place with `new`'s (the same size), their modification time put back."""
    weights, source = folder / WEIGHTS, new / WEIGHTS
    assert weights.stat().st_size == source.stat().st_size
    before = weights.stat()
    with weights.open("r+b") as f:
        f.write(source.read_bytes())
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def copy_of(export: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "served"
    shutil.copytree(export, folder)
    return folder


# --- the model -------------------------------------------------------------------------------------------------------


def test_the_folder_is_compared_by_content(served_export, reweighted_export, tmp_path):
    """`check()` passes while the folder holds what was loaded, even through a rename of an identical copy, and names
    each change otherwise: a same-size overwrite with its mtime put back, a truncation, another export, a removal."""
    from paradecode.runtime.loader import open_export

    folder = copy_of(served_export, tmp_path)
    files = open_export(folder).files
    assert files.changed() == []
    shutil.copyfile(folder / WEIGHTS, tmp_path / "copy")
    os.replace(tmp_path / "copy", folder / WEIGHTS)  # the same bytes in another file
    assert files.changed() == []

    overwrite_in_place(folder, reweighted_export)
    assert files.changed() == [f"{WEIGHTS}: other content of the same size"]
    size = (folder / WEIGHTS).stat().st_size
    os.truncate(folder / WEIGHTS, size // 2)
    assert files.changed() == [f"{WEIGHTS}: {size} -> {size // 2} bytes"]
    with pytest.raises(ExportChangedError, match=f"changed on disk after this model loaded them .{WEIGHTS}: {size} ->"):
        files.check()

    shutil.rmtree(folder)
    shutil.copytree(reweighted_export, folder)
    assert files.changed() == [
        "manifest.json: another manifest (another export)",
        f"{WEIGHTS}: other content of the same size",
    ]
    (folder / WEIGHTS).unlink()
    assert files.changed()[1] == f"{WEIGHTS}: missing"
    shutil.rmtree(folder)
    shutil.copytree(served_export, folder)  # the loaded files put back
    assert files.changed() == []


def test_a_graph_opened_after_the_folder_changed_is_the_loaded_one(served_export, reweighted_export, tmp_path):
    """A session made at a subgraph's first call, after the folder was replaced, computes with the loaded weights;
    and the model refuses requests until the loaded files are back."""
    from paradecode.runtime import load

    folder = copy_of(served_export, tmp_path)
    ids = {"input_ids": torch.tensor([[3, 5, 7]], dtype=torch.int64)}
    with load(folder) as model, load(served_export) as loaded, load(reweighted_export) as other:
        model.backend.close_subgraphs(model.backend.subgraph_names)  # each one's session is made again at its call
        replace_by_rename(folder, reweighted_export)
        (embed,) = [name for name, sub in model.backend.subgraphs.items() if sub.io.kind == "embed"]
        assert torch.equal(model.backend.run(embed, ids)["hidden"], loaded.backend.run(embed, ids)["hidden"])
        assert not torch.equal(loaded.backend.run(embed, ids)["hidden"], other.backend.run(embed, ids)["hidden"])
        with pytest.raises(ExportChangedError, match="manifest.json: another manifest"):
            model.generate(prompt_ids=[1, 2], max_new_tokens=2)
        shutil.rmtree(folder)
        shutil.copytree(served_export, folder)
        assert model.generate(prompt_ids=[1, 2], max_new_tokens=2).token_ids


def in_vocab_entry(data: bytes, old: bytes, new: bytes) -> bytes:
    """The weights' bytes with `old` replaced by `new` once, in exits.vocab's header entry (the first after its name:
    other int64 tensors, the draft head's vocabulary, come before it)."""
    at = data.index(b'"exits.vocab"')
    return data[:at] + data[at:].replace(old, new, 1)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:4], "too short for a safetensors file"),
        (lambda data: (1 << 40).to_bytes(8, "little") + data[8:], "its safetensors header claims"),
        (lambda data: data.replace(b'"exits.vocab"', b'"exits.vocaX"', 1), "has no tensor 'exits.vocab'"),
        (lambda data: in_vocab_entry(data, b'"I64"', b'"X64"'), "expected a known dtype"),
        (lambda data: in_vocab_entry(data, b'"I64"', b"[6,4]"), "expected a known dtype"),  # a list: a TypeError
    ],
    ids=["short", "header-length", "missing", "dtype", "dtype-list"],
)
def test_a_tensor_read_from_the_weights_bytes_checks_the_header(exports, damage, message):
    from paradecode.runtime.loader import open_export
    from paradecode.runtime.safetensors_bytes import tensor_from_safetensors

    export = open_export(exports["llama"][0])
    data = export.read(export.manifest.weights)
    vocab = tensor_from_safetensors(data, "exits.vocab", "w")
    assert vocab.dtype == torch.int64 and tuple(vocab.shape) == (export.manifest.head_vocab,)
    with pytest.raises(ManifestError, match=message):
        tensor_from_safetensors(damage(data), "exits.vocab", "w")


def test_a_shape_no_tensor_can_have_is_a_manifest_error():
    """An empty tensor of a dimension torch cannot make ([0, 10**20]) was a RuntimeError."""
    import json
    import struct

    from paradecode.runtime.safetensors_bytes import tensor_from_safetensors

    header = json.dumps({"t": {"dtype": "F32", "shape": [0, 10**20], "data_offsets": [0, 0]}}).encode()
    with pytest.raises(ManifestError, match="expected a known dtype, a shape of non-negative integers"):
        tensor_from_safetensors(struct.pack("<Q", len(header)) + header, "t", "w")


# --- the server ------------------------------------------------------------------------------------------------------


def answers(running) -> str:
    response = running.post("/v1/completions", BODY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def text_of(response: httpx.Response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["text"]
    return "".join(event["choices"][0]["text"] for event in sse_events(response.text.splitlines()) if event != "[DONE]")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("change", "other"),
    [(replace_by_rename, "reweighted"), (overwrite_in_place, "reweighted"), (replace_by_rename, "another model")],
    ids=["re-exported", "overwritten-mtime-restored", "another-model"],
)
def test_a_changed_export_is_never_served_as_the_loaded_one(
    serve, served_export, reweighted_export, identity_exports, tmp_path, caplog, change, other
):
    """Changed before the first request: the loaded model's own answer, or 503 export_changed with /health 503 and a
    log line; never the new folder's answer, and never a 500."""
    new = reweighted_export if other == "reweighted" else identity_exports["qwen2"][0]
    loaded_answer = answers(serve(served_export))
    if other == "reweighted":
        assert answers(serve(reweighted_export)) != loaded_answer, "the two exports answer alike: nothing to tell apart"
    folder = copy_of(served_export, tmp_path)
    running = serve(folder)
    change(folder, new)
    refused = 0
    for stream in (False, True):
        response = running.post("/v1/completions", {**BODY, "stream": stream})
        if response.status_code == 200:
            assert text_of(response, stream) == loaded_answer
        else:
            assert response.status_code == 503 and response.json()["error"]["code"] == "export_changed", response.text
            health = running.http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "export_changed"
            assert "changed on disk" in caplog.text
            assert str(tmp_path) not in response.text and str(tmp_path) not in health.text
            refused += 1
    if refused:  # one line for each changed file, not one per refused request or /health
        lines = [r.getMessage() for r in caplog.records if "changed on disk" in r.getMessage()]
        assert lines and len(lines) == len(set(lines)), caplog.text


TRUNCATING_SERVER = """
import os, sys, time
from pathlib import Path
from paradecode.runtime.backends import base
from paradecode.runtime.serve import cli
trigger, weights, size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
real = base.Backend.run
def run(self, name, *args, **kwargs):
    if name == "embed":  # once per step: slow steps, and the weights truncated inside one once the test says so
        time.sleep(0.02)
        if trigger.exists() and os.stat(weights).st_size > size:
            os.truncate(weights, size)
    return real(self, name, *args, **kwargs)
base.Backend.run = run
sys.exit(cli.main(sys.argv[4:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("streams", "to_half"), [(1, False), (6, True)], ids=["one-stream-to-0", "6-batched-to-half"])
def test_weights_truncated_while_decoding_do_not_kill_the_server(served_export, tmp_path, streams, to_half):
    """In a subprocess (a SIGBUS would kill it: exit 135): the weights truncated inside a decoding step, one stream
    alone or six batched. Each stream completes or ends with export_changed; then /health and requests answer 503
    export_changed with a log line, and the server stops on SIGTERM as usual."""
    folder = copy_of(served_export, tmp_path)
    trigger, weights, log = tmp_path / "truncate-now", folder / WEIGHTS, tmp_path / "log"
    size = weights.stat().st_size // 2 if to_half else 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = ["--max-batch", "1"] if streams == 1 else ["--max-batch", str(streams)]
    argv = [str(trigger), str(weights), str(size), str(folder), "--port", str(port), "--served-model-name", NAME, *rows]
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", TRUNCATING_SERVER, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=REPO
        )

    def up() -> bool:
        assert process.poll() is None, f"paradecode-serve exited with {process.returncode}: {log.read_text()}"
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stream(_) -> list:
        body = {**BODY, "max_tokens": 40, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                events = []
                for line in response.iter_lines():
                    events += sse_events([line])
                    if len(events) == 2:
                        trigger.touch()  # the next step truncates the weights
                return events
        except httpx.HTTPError as err:
            return [err]

    try:
        wait_until(up, 60, "paradecode-serve's start")
        with ThreadPoolExecutor(streams) as pool:
            results = list(pool.map(stream, range(streams)))
        assert process.poll() is None, f"the server died ({process.returncode}): {log.read_text()[-2000:]}"
        assert weights.stat().st_size == size, "the weights were not truncated while decoding"
        for events in results:
            assert events and events[-1] == "[DONE]", events[-3:]
            last = events[-2]
            if "error" in last:
                assert last["error"]["code"] == "export_changed", last
            else:
                assert last["choices"][0]["finish_reason"] == "length", last
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "export_changed", health.text
        again = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert again.status_code == 503 and again.json()["error"]["code"] == "export_changed", again.text
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    text = log.read_text()
    assert process.returncode == 128 + signal.SIGTERM, text[-2000:]
    assert f"{WEIGHTS} changed on disk" in text and "refused a request" not in text  # logged when found only
