"""Tokenizer files for an export: copied verbatim, plus a `tokenizer.json` where the source lacks one.

The runtime reads `tokenizer.json` with the `tokenizers` library alone (no transformers), so a model
that ships only a SentencePiece `tokenizer.model` gets one converted by transformers here.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from paradecode.export.source import TOKENIZER_FILES, tokenizer_json_problem

logger = logging.getLogger(__name__)


# Files a tokenizer can be rebuilt from (generation_config.json travels along but is not one).
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


def save_tokenizer(model_path: Path, folder: Path) -> list[str]:
    """Write the tokenizer into `folder`; return the file names written (empty: the model has none)."""
    present = [name for name in TOKENIZER_FILES if (model_path / name).is_file()]
    if not any(name in TOKENIZER_SOURCES for name in present):
        logger.warning("%s has no tokenizer files: the export will take token ids only", model_path)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    for name in present:
        shutil.copyfile(model_path / name, folder / name)
    if "tokenizer.json" not in present and convert_to_tokenizer_json(model_path, folder / "tokenizer.json"):
        present.append("tokenizer.json")
    return sorted(present)


def convert_to_tokenizer_json(model_path: Path, target: Path) -> bool:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError, ImportError) as err:
        logger.warning(
            "could not load the tokenizer of %s to convert it (%s): the runtime will take token ids only",
            model_path,
            err,
        )
        return False
    with tempfile.TemporaryDirectory(prefix="paradecode-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        converted = Path(tmp) / "tokenizer.json"
        if not converted.is_file() or tokenizer_json_problem(converted) is not None:
            logger.warning(
                "transformers wrote no usable tokenizer.json for %s: the runtime will take token ids only", model_path
            )
            return False
        shutil.copyfile(converted, target)
    return True
