"""Where a model comes from: a local folder, a GGUF file, a known short name or a Hugging Face Hub id.

Everything is checked before anything is written. Which one `MODEL` names, in this order: a name from
`known_models` is that model's GGUF file (`./NAME` reaches a path of the same name); an existing file
is a GGUF file; an existing folder is a model folder written by `save_pretrained`; `owner/name` is a
Hub id. A name without a slash that is none of these is refused with the known names listed (Hub
ids without an owner, such as `gpt2`, have owner forms: `openai-community/gpt2`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from paradecode.export.gguf_file import check_gguf_file, config_from_gguf, config_sha256
from paradecode.export.known_models import KNOWN_MODELS, locate
from paradecode.graphs.errors import UserInputError
from paradecode.graphs.manifest import sha256_of

logger = logging.getLogger(__name__)

# Transformers' own weight file names (single and sharded): other .safetensors files in the folder, such
# as exit heads saved beside the model, are not the model's weights and must not change its hash.
WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "pytorch_model.bin", "pytorch_model-*-of-*.bin")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    reference: str  # what the user gave: a folder, a .gguf file, a known short name or a hub id
    path: Path  # the local folder holding config.json and the weights, or holding the GGUF file
    hub_id: str | None = None
    gguf_file: str | None = None  # the GGUF file's name inside `path`
    known_name: str | None = None  # the short name it was resolved from (see known_models)

    @property
    def gguf_path(self) -> Path | None:
        return None if self.gguf_file is None else self.path / self.gguf_file

    @property
    def pretrained_kwargs(self) -> dict[str, str]:
        """What transformers' `from_pretrained(str(source.path), ...)` needs besides the folder."""
        return {} if self.gguf_file is None else {"gguf_file": self.gguf_file}

    @property
    def weight_files(self) -> list[Path]:
        if self.gguf_path is not None:
            return [self.gguf_path]
        return sorted({f for pattern in WEIGHT_PATTERNS for f in self.path.glob(pattern)})

    @cached_property
    def gguf_config(self):
        """The config transformers derives from the GGUF file's metadata (read once: it takes seconds)."""
        return config_from_gguf(self.gguf_path, self.reference)

    def config_dict(self) -> dict[str, Any]:
        if self.gguf_path is not None:
            return self.gguf_config.to_dict()
        return json.loads((self.path / "config.json").read_text())

    def identity(self) -> dict[str, Any]:
        """Model identity for the manifest: where it came from and hashes of its config and weights.

        For a GGUF file the weights hash is the file's own sha256 and the config hash is taken over the
        config transformers derives from it, so heads trained on it (`paradecode-train-heads`) match.
        """
        config = self.config_dict()
        common = {
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "bos_token_id": config.get("bos_token_id"),
            "eos_token_id": config.get("eos_token_id"),
        }
        if self.gguf_path is not None:
            return {
                "source": self.known_name or str(self.gguf_path),
                "hub_id": None,
                "gguf_file": str(self.gguf_path),
                **common,
                "config_sha256": config_sha256(config),
                "weights_sha256": sha256_of(self.gguf_path),
            }
        digest = hashlib.sha256()
        for f in self.weight_files:
            digest.update(f.name.encode() + b"\0" + sha256_of(f).encode())
        return {
            "source": self.hub_id or str(self.path.resolve()),
            "hub_id": self.hub_id,
            **common,
            "config_sha256": sha256_of(self.path / "config.json"),
            "weights_sha256": digest.hexdigest(),
        }


def resolve_model(reference: str) -> ModelSource:
    """Check that `reference` names a model (see the module's docstring for the order) and return it."""
    path = Path(reference).expanduser()
    if reference in KNOWN_MODELS:
        if path.exists():
            logger.warning(
                "%r is a known model name and also a path here: using the known model (pass ./%s for the path)",
                reference,
                reference,
            )
        return gguf_source(reference, locate(KNOWN_MODELS[reference]), known_name=reference)
    if path.is_file():
        return gguf_source(reference, path)
    if path.exists():
        source = ModelSource(reference, path)
        check_model_folder(source)
        return source
    if path.suffix.lower() == ".gguf":
        raise UserInputError(f"{reference}: no such file. Expected the path of a .gguf model file.")
    known = ", ".join(sorted(KNOWN_MODELS))
    if HUB_ID.match(reference) and not reference.startswith("."):
        source = ModelSource(reference, download(reference), hub_id=reference)
        check_model_folder(source)
        return source
    if "/" not in reference and os.sep not in reference:
        raise UserInputError(
            f"{reference!r} is not a known model name ({known}), and neither an existing folder nor a Hugging "
            "Face Hub id (which has the form owner/name, e.g. `HuggingFaceTB/SmolLM2-135M`). "
            "`paradecode-export --help` describes the known names."
        )
    raise UserInputError(
        f"{reference!r} is neither an existing folder nor a Hugging Face Hub id. Expected a folder written by "
        f"`save_pretrained` (config.json and weights), a .gguf file, a known model name ({known}) or an id such "
        "as `HuggingFaceTB/SmolLM2-135M`."
    )


def gguf_source(reference: str, path: Path, known_name: str | None = None) -> ModelSource:
    """A GGUF file, checked: its magic bytes here, its metadata by transformers (which refuses a damaged file)."""
    check_gguf_file(path, reference)
    path = Path(os.path.abspath(path))  # absolute, but not through symlinks: the file keeps its name
    source = ModelSource(reference, path.parent, gguf_file=path.name, known_name=known_name)
    if not source.config_dict().get("model_type"):
        raise UserInputError(f"{reference}: transformers derived no model_type from the GGUF file's metadata.")
    return source


def check_model_folder(source: ModelSource) -> None:
    path = source.path
    if not path.is_dir():
        raise UserInputError(
            f"{source.reference} is a file, not a model folder. Pass the folder that holds config.json."
        )
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if ggufs:
            raise UserInputError(
                f"{source.reference} has no config.json but holds {', '.join(ggufs)}: pass the .gguf file itself "
                f"(e.g. {path / ggufs[0]}) as MODEL."
            )
        raise UserInputError(
            f"{source.reference} is not a Hugging Face model folder: it has no config.json. Expected a folder "
            "written by `save_pretrained` (config.json plus model*.safetensors or pytorch_model*.bin)."
        )
    try:
        config = source.config_dict()
    except json.JSONDecodeError as err:
        raise UserInputError(f"{path / 'config.json'} is not valid JSON ({err}).") from err
    if not isinstance(config, dict) or "model_type" not in config:
        raise UserInputError(f"{path / 'config.json'} has no model_type: it does not describe a Hugging Face model.")
    if not source.weight_files:
        raise UserInputError(
            f"{source.reference} has a config.json but no weights: expected model.safetensors (or its shards "
            "model-*-of-*.safetensors) or pytorch_model*.bin "
            "next to it. Save the model with `model.save_pretrained(folder)`."
        )
    for weights in source.weight_files:
        check_safetensors_file(weights)
    check_tokenizer_json(path / "tokenizer.json")


def check_safetensors_file(path: Path) -> None:
    """Refuse a .safetensors file whose header does not parse or does not cover the file (a truncated copy)."""
    if path.suffix != ".safetensors":
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise UserInputError(
            f"{path} is not a readable safetensors file: {err}. It is probably truncated (an interrupted download "
            "or copy): download or save the model again."
        ) from err


def tokenizer_json_problem(path: Path) -> str | None:
    """What is wrong with a tokenizer.json for the `tokenizers` library, or None when it loads with a vocabulary."""
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size()
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        return f"the tokenizers library cannot read it: {err}"
    return None if size > 0 else "its vocabulary is empty"


def check_tokenizer_json(path: Path) -> None:
    """Refuse a model folder whose tokenizer.json is present but unusable (absent is fine)."""
    if not path.exists():
        return
    problem = tokenizer_json_problem(path) if path.is_file() else "it is not a file"
    if problem is not None:
        raise UserInputError(
            f"{path} is not a usable tokenizer file: {problem}. Replace it with the model's own tokenizer.json "
            "(`tokenizer.save_pretrained(folder)`), or delete it to export without a tokenizer."
        )


def download(hub_id: str) -> Path:
    """Fetch config, weights and tokenizer files of `hub_id` from the Hugging Face Hub (or its local cache)."""
    from huggingface_hub import snapshot_download

    patterns = [
        "config.json",
        *WEIGHT_PATTERNS,
        "*.safetensors.index.json",
        "pytorch_model.bin.index.json",
        *TOKENIZER_FILES,
    ]
    logger.info("fetching %s from the Hugging Face Hub (or its local cache)", hub_id)
    try:
        return Path(snapshot_download(repo_id=hub_id, allow_patterns=patterns))
    except Exception as err:  # huggingface_hub raises many types (network, auth, not found)
        raise UserInputError(
            f"could not fetch {hub_id!r} from the Hugging Face Hub ({type(err).__name__}: {str(err).splitlines()[0]}). "
            "Check the id and your network, or pass a local folder written by `save_pretrained`."
        ) from err
