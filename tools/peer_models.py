"""The models the benchmark's peers run, made from the export's own source and cached.

- onnxruntime-genai runs what its model builder writes (`python -m onnxruntime_genai.models.builder -i DIR
  -o OUT -p int4|fp32 -e cpu`) from a Hugging Face folder: the source folder itself, or, for a GGUF file, a
  float folder written from the model transformers dequantizes. A GGUF-loaded model refuses
  `save_pretrained` (docs/design.md §8), so its weights go into a fresh model of the same config without the
  `quantization_config`. (The builder reads float GGUF files only, not quantized ones.) Each build is kept
  under the cache folder, one per source weights, builder version and precision:
  `CACHE/<weights sha256>/ort-genai-<version>/<precision>/`, with `build.json` saying how it was made; it is
  staged beside its place and renamed into it only when the build succeeded.
- llama.cpp runs the GGUF file itself.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from paradecode.export.source import ModelSource
from paradecode.graphs.errors import UnsupportedModelError, UserInputError

logger = logging.getLogger(__name__)

DEFAULT_CACHE = Path.home() / ".cache" / "paradecode" / "peers"
BUILDER = "onnxruntime_genai.models.builder"
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them: the builder saves it
LOG_TAIL_LINES = 12  # of the builder's log, in the error when it fails


def peer_source(reference: str | None, manifest) -> ModelSource:
    """The model the peers run: `reference` (--peer-source), else the export's recorded source where it is on
    this machine (a folder, a .gguf file or a known short name); warns when it is not the export's model."""
    from paradecode.export.known_models import KNOWN_MODELS
    from paradecode.export.source import resolve_model

    recorded = manifest.model.get("source")
    if reference is None:
        if not recorded or not (recorded in KNOWN_MODELS or Path(recorded).exists()):
            raise UserInputError(
                f"the export was made from {recorded!r}, which is not on this machine (a folder, a .gguf file or a "
                "known short name): the peers need the original model. Pass --peer-source MODEL with a local copy."
            )
        reference = recorded
    source = resolve_model(reference)
    ours, theirs = source.identity()["weights_sha256"], manifest.model.get("weights_sha256")
    if ours != theirs:
        logger.warning(
            "--peer-source %s is not the model this export was made from (weights sha256 %s..., the export's "
            "%s...): the peer rows compare another model",
            reference,
            ours[:12],
            str(theirs)[:12],
        )
    return source


def gguf_file_of(source: ModelSource) -> Path:
    """The GGUF file llama.cpp runs, refused where the source is a folder."""
    if source.gguf_path is None:
        raise UnsupportedModelError(
            f"llama.cpp runs GGUF files, and the peers' source {source.reference} is a Hugging Face folder. Pass "
            "--peer-source FILE.gguf (the same model converted with llama.cpp's convert_hf_to_gguf.py), or leave "
            "llama.cpp out of --peers."
        )
    return source.gguf_path


def genai_version() -> str:
    return metadata.version("onnxruntime-genai")


def genai_model_folder(source: ModelSource, precision: str, cache: Path) -> Path:
    """onnxruntime-genai's model of `source` at `precision` for the CPU: from the cache, or built into it."""
    weights = source.identity()["weights_sha256"]
    version = genai_version()
    folder = Path(cache).expanduser() / weights / f"ort-genai-{version}" / precision
    if (folder / "genai_config.json").is_file():
        logger.info("onnxruntime-genai %s model of %s: %s (cached)", precision, source.reference, folder)
        return folder
    build_genai_model(source, precision, folder, weights=weights, version=version)
    return folder


def build_genai_model(source: ModelSource, precision: str, folder: Path, *, weights: str, version: str) -> None:
    """Run onnxruntime-genai's model builder on `source` into `folder` (staged, renamed into place at the end)."""
    from paradecode.export.files import staged_folder

    if source.gguf_path is None and not any((source.path / name).is_file() for name in TOKENIZER_NAMES):
        raise UnsupportedModelError(
            f"onnxruntime-genai's model builder needs the model's tokenizer, and {source.path} has none "
            f"({', '.join(TOKENIZER_NAMES)}). Save it there (`tokenizer.save_pretrained(folder)`), or leave "
            "ort-genai out of --peers."
        )
    log = folder.with_name(f"{precision}.build.log")  # kept beside the model, so a failed build leaves its log
    started = time.perf_counter()
    logger.info(
        "onnxruntime-genai %s: building the %s model of %s with its model builder (once; cached in %s; log %s)",
        version,
        precision,
        source.reference,
        folder,
        log,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with (
        staged_folder(folder, force=True) as staged,
        tempfile.TemporaryDirectory(prefix=".build-", dir=folder.parent) as scratch,
    ):
        scratch = Path(scratch)
        hf_folder = source.path
        if source.gguf_path is not None:
            hf_folder = scratch / "float-model"
            write_float_folder(source, hf_folder)
        command = [sys.executable, "-m", BUILDER, "-i", str(hf_folder), "-o", str(staged), "-p", precision]
        command += ["-e", "cpu", "-c", str(scratch / "builder-cache")]
        with open(log, "w") as out:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        if code != 0 or not (staged / "genai_config.json").is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
            raise UnsupportedModelError(
                f"onnxruntime-genai's model builder could not build the {precision} CPU model of {source.reference} "
                f"(exit code {code}; the whole log is {log}). Its last lines:\n{tail}\nLeave ort-genai out of "
                "--peers for this model."
            )
        record = {
            "source": source.reference,
            "weights_sha256": weights,
            "precision": precision,
            "onnxruntime_genai": version,
            "float_folder_from_gguf": source.gguf_path is not None,
            "command": [Path(command[0]).name, *command[1:]],
            "seconds": round(time.perf_counter() - started, 1),
        }
        (staged / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    logger.info("built %s in %.0f s", folder, time.perf_counter() - started)


def write_float_folder(source: ModelSource, folder: Path) -> None:
    """A Hugging Face folder (float32 weights, config, tokenizer) of the model transformers reads from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    from paradecode.export.pipeline import load_hf_model
    from paradecode.export.tokenizer import hf_tokenizer

    logger.info("writing a float32 Hugging Face folder of %s for the model builder", source.reference)
    tokenizer = hf_tokenizer(source)
    if tokenizer is None:
        raise UnsupportedModelError(
            f"onnxruntime-genai's model builder needs the model's tokenizer, and transformers builds none from "
            f"{source.reference}. Leave ort-genai out of --peers for this model."
        )
    loaded = load_hf_model(source)  # dequantized to float32, every tensor checked
    values = loaded.config.to_dict()
    values.pop("quantization_config", None)  # what makes save_pretrained refuse a GGUF-loaded model
    config = type(loaded.config).from_dict(values)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
