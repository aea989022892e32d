"""Where a model comes from: a local folder or a Hugging Face Hub id, checked before anything is written."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelSource:
    reference: str  # what the user gave: a folder or a hub id
    path: Path  # the local folder holding config.json and the weights
    hub_id: str | None = None

    @property
    def weight_files(self) -> list[Path]:
        return sorted({f for pattern in WEIGHT_PATTERNS for f in self.path.glob(pattern)})

    def config_dict(self) -> dict[str, Any]:
        return json.loads((self.path / "config.json").read_text())

    def identity(self) -> dict[str, Any]:
        """Model identity for the manifest: where it came from and hashes of its config and weights."""
        config = self.config_dict()
        digest = hashlib.sha256()
        for f in self.weight_files:
            digest.update(f.name.encode() + b"\0" + sha256_of(f).encode())
        return {
            "source": self.hub_id or str(self.path.resolve()),
            "hub_id": self.hub_id,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "config_sha256": sha256_of(self.path / "config.json"),
            "weights_sha256": digest.hexdigest(),
            "bos_token_id": config.get("bos_token_id"),
            "eos_token_id": config.get("eos_token_id"),
        }


def resolve_model(reference: str) -> ModelSource:
    """Check that `reference` names a model: a folder with config.json and weights, or a hub id."""
    path = Path(reference).expanduser()
    if path.exists():
        source = ModelSource(reference, path)
    elif HUB_ID.match(reference) and not reference.startswith("."):
        source = ModelSource(reference, download(reference), hub_id=reference)
    else:
        raise UserInputError(
            f"{reference!r} is neither an existing folder nor a Hugging Face Hub id. Expected a folder "
            "written by `save_pretrained` (config.json and weights) or an id such as `HuggingFaceTB/SmolLM2-135M`."
        )
    check_model_folder(source)
    return source


def check_model_folder(source: ModelSource) -> None:
    path = source.path
    if not path.is_dir():
        raise UserInputError(
            f"{source.reference} is a file, not a model folder. Pass the folder that holds config.json."
        )
    if not (path / "config.json").is_file():
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
