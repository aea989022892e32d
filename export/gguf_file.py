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
import re
import struct
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import MissingDependencyError, UnsupportedModelError, UserInputError
from paradecode.graphs.untrusted import show

MAGIC = b"GGUF"
GGUF_PACKAGES = ("gguf", "accelerate")  # what transformers needs to read a GGUF file
# What reading a damaged file raises inside the gguf reader and transformers (numpy reshapes, struct
# unpacking, dictionary look-ups of missing keys, mmap of an empty file).
READ_ERRORS = (ValueError, OSError, struct.error, KeyError, IndexError, OverflowError, EOFError)
# Config entries that depend on where and with what the file was read, not on the file.
UNSTABLE_CONFIG_KEYS = ("_name_or_path", "transformers_version")
# The metadata sizes transformers builds a model from (under the architecture's prefix, `llama.block_count`):
# each must be a positive integer. A per-layer list (some architectures write one) is left to transformers.
SIZE_KEYS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "context_length",
    "attention.head_count",
    "attention.head_count_kv",
)
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")  # llama.cpp's name of a layer's tensor: blk.3.attn_q.weight


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


def read_error(reference: str, what: str, err: BaseException, reader: str = "transformers") -> UserInputError:
    first = str(err).splitlines()[0] if str(err) else ""
    return UserInputError(
        f"{reader} could not read the {what} of the GGUF file {reference} ({type(err).__name__}: {first}). "
        "If the file is truncated or corrupt (an interrupted download or copy), download it again; otherwise "
        "its architecture may be one transformers cannot read from GGUF."
    )


def check_gguf_sizes(path: Path, reference: str) -> None:
    """Refuse metadata sizes that cannot be right (not positive, not dividing, not what the tensors hold) before
    transformers builds anything from them.

    transformers takes the sizes on trust: a `block_count` of 1,000,000 over the 4 blocks a file holds had it build
    layer after layer for minutes (100% CPU, memory growing), a `head_count` of 0 divided by zero. So each size must
    be a positive integer, `block_count` must be the number of blocks the tensors are named for (`blk.N.*`), the
    attention heads must divide the embedding (and the key/value heads the heads), and `embedding_length` must be
    the row length of `token_embd.weight`. Reading the header and tensor table costs no per-layer work.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        arch = metadata_value(reader, "general.architecture")
        if not isinstance(arch, str):
            return  # transformers refuses a file without an architecture with its own message
        sizes = {f"{arch}.{key}": metadata_value(reader, f"{arch}.{key}") for key in SIZE_KEYS}
        blocks = {int(m.group(1)) for t in reader.tensors if (m := BLOCK_TENSOR.match(t.name))}
        embed_rows = next((int(t.shape[0]) for t in reader.tensors if t.name == "token_embd.weight"), None)
        unread = UNREAD_BY_TRANSFORMERS[arch](reader, arch) if arch in UNREAD_BY_TRANSFORMERS else []
    except READ_ERRORS as err:  # UnicodeDecodeError (a ValueError) for a string that is not UTF-8
        raise read_error(reference, "metadata", err, reader="the gguf package") from err
    if unread:
        raise UnsupportedModelError(
            f"transformers reads the GGUF file {reference} without {' and without '.join(unread)}, so the float model "
            "it builds (the export's reference) would not be the file's model. Export the model's Hugging Face folder "
            "instead: its config.json carries them."
        )
    problems = [
        f"{key} is {show(value)}, expected a positive integer"
        for key, value in sizes.items()
        if value is not None and not isinstance(value, list) and not is_positive_int(value)
    ]
    block_count = sizes[f"{arch}.block_count"]
    if is_positive_int(block_count) and block_count != len(blocks):
        problems.append(
            f"{arch}.block_count is {block_count}, but the file holds the tensors of {len(blocks)} blocks"
            + (f" (blk.{min(blocks)} to blk.{max(blocks)})" if blocks else "")
        )
    embedding, heads = sizes[f"{arch}.embedding_length"], sizes[f"{arch}.attention.head_count"]
    kv_heads = sizes[f"{arch}.attention.head_count_kv"]
    if is_positive_int(embedding) and is_positive_int(heads) and embedding % heads:
        problems.append(f"{arch}.embedding_length {embedding} is not a multiple of {arch}.attention.head_count {heads}")
    if is_positive_int(heads) and is_positive_int(kv_heads) and heads % kv_heads:
        problems.append(
            f"{arch}.attention.head_count {heads} is not a multiple of {arch}.attention.head_count_kv {kv_heads}"
        )
    if is_positive_int(embedding) and embed_rows is not None and embed_rows != embedding:
        problems.append(f"{arch}.embedding_length is {embedding}, but token_embd.weight holds rows of {embed_rows}")
    if problems:
        raise UserInputError(
            f"the GGUF file {reference} has sizes in its metadata that cannot be right: {'; '.join(problems)}. "
            "Its metadata was damaged or edited: download the model again, or convert it again with llama.cpp's "
            "convert_hf_to_gguf.py, which writes the sizes from the model's config."
        )


def chat_template_of_gguf(path: Path, reference: str) -> str | None:
    """The file's `tokenizer.chat_template` (transformers' chat template for its tokenizer), None without one."""
    from gguf import GGUFReader

    try:
        value = metadata_value(GGUFReader(str(path)), "tokenizer.chat_template")
    except READ_ERRORS as err:
        raise read_error(reference, "chat template", err, reader="the gguf package") from err
    if value is not None and not isinstance(value, str):
        raise UserInputError(
            f"the GGUF file {reference} holds a tokenizer.chat_template of {type(value).__name__}; expected a string "
            "of jinja2 source. Convert the model to GGUF again."
        )
    return value


def _rope_scaling_unread(reader, arch: str) -> list[str]:
    """transformers' GGUF mappings of gemma3 and phi3 read no rope scaling: a file that states one is misread."""
    kind = metadata_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return []
    return [f"its rope scaling ({arch}.rope.scaling.type {show(kind)})"]


def _phi3_unread(reader, arch: str) -> list[str]:
    """Also no longrope factors (tensors of their own) and no partial rotary dims (transformers turns them all)."""
    unread = _rope_scaling_unread(reader, arch)
    factors = sorted(t.name for t in reader.tensors if t.name.startswith("rope_factors_"))
    if factors:
        unread.append(f"its longrope factors ({', '.join(factors)})")
    dims = metadata_value(reader, f"{arch}.rope.dimension_count")
    width, heads = (
        metadata_value(reader, f"{arch}.embedding_length"),
        metadata_value(reader, f"{arch}.attention.head_count"),
    )
    if all(is_positive_int(v) for v in (dims, width, heads)) and dims != width // heads:
        unread.append(
            f"its partial rotary embedding ({arch}.rope.dimension_count {dims} of {width // heads} head dims)"
        )
    return unread


# What transformers' GGUF reader leaves out of a model of these architectures, by architecture.
UNREAD_BY_TRANSFORMERS = {"gemma3": _rope_scaling_unread, "phi3": _phi3_unread}


def metadata_value(reader, key: str) -> Any:
    """A metadata field's value (a list for an array), or None when the file has no such key."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def config_from_gguf(path: Path, reference: str):
    """The transformers config derived from the file's metadata, once its sizes are checked."""
    require_gguf_support()
    check_gguf_sizes(path, reference)
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
