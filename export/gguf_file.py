"""A GGUF file as a model source: its checks, the config transformers derives from it, its hashes.

transformers reads a GGUF file itself (`from_pretrained(folder, gguf_file=name)`, with the `gguf`
and `accelerate` packages): it derives a config from the file's metadata, dequantizes the weights
and builds the tokenizer (with its chat template) from the `tokenizer.*` keys. A GGUF file has no
config.json, so the config's hash is taken over the config transformers derives, without the
entries that name the folder it was read from or the transformers version.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import MissingDependencyError, UnsupportedModelError, UserInputError

MAGIC = b"GGUF"
GGUF_PACKAGES = ("gguf", "accelerate")  # what transformers needs to read a GGUF file
# What reading a damaged file raises inside the gguf reader and transformers (numpy reshapes, struct
# unpacking, dictionary look-ups of missing keys, mmap of an empty file).
READ_ERRORS = (ValueError, OSError, struct.error, KeyError, IndexError, OverflowError, EOFError)
# Config entries that depend on where and with what the file was read, not on the file.
UNSTABLE_CONFIG_KEYS = ("_name_or_path", "transformers_version")


def check_gguf_file(path: Path, reference: str) -> None:
    """Refuse what cannot be a GGUF file before transformers is asked to read it."""
    if not path.is_file():
        raise UserInputError(f"{reference} is not a regular file. Expected a .gguf model file.")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        fix = (
            "Download or convert the model again (llama.cpp's convert_hf_to_gguf.py writes GGUF files)"
            if path.suffix.lower() == ".gguf"
            else "Pass a model folder written by `save_pretrained` (config.json and weights) or a .gguf file"
        )
        raise UserInputError(
            f"{reference} is a file but not a GGUF file: it starts with {head!r}, expected the magic bytes "
            f"{MAGIC!r}{' (the file is empty)' if not head else ''}. {fix}."
        )


def require_gguf_support() -> None:
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"reading a GGUF file needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}, "
            "which transformers uses to read and dequantize it. Install them with "
            "`pip install 'paradecode[gguf]'` (or `pip install gguf accelerate`)."
        )


def read_error(reference: str, what: str, err: BaseException) -> UserInputError:
    first = str(err).splitlines()[0] if str(err) else ""
    return UserInputError(
        f"transformers could not read the {what} of the GGUF file {reference} ({type(err).__name__}: {first}). "
        "If the file is truncated or corrupt (an interrupted download or copy), download it again; otherwise "
        "its architecture may be one transformers cannot read from GGUF."
    )


def config_from_gguf(path: Path, reference: str):
    """The transformers config derived from the file's metadata."""
    require_gguf_support()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except READ_ERRORS as err:
        raise read_error(reference, "metadata", err) from err


def config_sha256(config_dict: dict[str, Any]) -> str:
    """sha256 of the derived config as canonical JSON, without the entries that vary with the reader."""
    stable = {k: v for k, v in config_dict.items() if k not in UNSTABLE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()


def model_from_gguf(path: Path, reference: str):
    """The model, dequantized to float32 by transformers, in eval mode.

    transformers sets a GGUF `quantization_config` on the model's config, which nothing in the
    exporter reads (it reads the state dict and the architecture's settings). A tensor missing from
    the file (transformers would leave it randomly initialised), or one transformers kept packed in
    GGUF blocks, is refused rather than exported.
    """
    import torch
    from transformers import AutoModelForCausalLM

    require_gguf_support()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, output_loading_info=True
        )
    except (*READ_ERRORS, RuntimeError) as err:
        raise read_error(reference, "weights", err) from err
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise UserInputError(
            f"the GGUF file {reference} lacks tensors the {model.config.model_type} model needs: "
            f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} ({len(missing)} in all). It was "
            "written for another architecture or is incomplete: convert the model to GGUF again."
        )
    packed = {name: p.dtype for name, p in model.named_parameters() if p.dtype != torch.float32}
    if packed:
        name, dtype = next(iter(packed.items()))
        raise UnsupportedModelError(
            f"transformers kept {len(packed)} tensors of {reference} in {dtype} ({name}, ...) instead of "
            "dequantizing them to float32; the exporter reads float weights only. Expected the float32 model "
            "that `from_pretrained(..., gguf_file=..., dtype=torch.float32)` gives for this architecture."
        )
    return model.eval()
