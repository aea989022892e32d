"""Tokenizer files for an export: copied verbatim, plus a `tokenizer.json` where the source lacks one.

The runtime reads `tokenizer.json` with the `tokenizers` library alone (no transformers), so a model
that ships only a SentencePiece `tokenizer.model` gets one converted by transformers here. A GGUF
file carries its tokenizer (and chat template) in its metadata: transformers builds it, and
`save_pretrained` writes tokenizer.json, tokenizer_config.json and chat_template.jinja.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from paradecode.export.source import TOKENIZER_FILES, ModelSource, tokenizer_json_problem
from paradecode.graphs.errors import ManifestError, UserInputError, raise_if_interrupted

logger = logging.getLogger(__name__)


# Files a tokenizer can be rebuilt from (generation_config.json travels along but is not one).
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


def check_chat_template(source: ModelSource) -> None:
    """Refuse, before any work, a chat template that the runtime refuses to load (`runtime/chat.py`: at most
    MAX_TEMPLATE_BYTES bytes and MAX_TEMPLATE_TOKENS tokens, compiled in its bounded sandbox), so an export is never
    written that paradecode-serve and paradecode-generate then refuse."""
    from paradecode.runtime.chat import ChatTemplate

    try:
        if source.gguf_path is None:
            ChatTemplate.from_folder(source.path)
            return
        from paradecode.export.gguf_file import chat_template_of_gguf

        template = chat_template_of_gguf(source.gguf_path, source.reference)
        if template is not None:
            ChatTemplate(template, origin=f"{source.reference}: its tokenizer.chat_template")
    except ManifestError as err:
        raise UserInputError(
            f"the chat template of {source.reference} would make its export unusable (paradecode-serve and "
            f"paradecode-generate refuse to load it): {err}"
        ) from err


def save_tokenizer(source: ModelSource, folder: Path) -> list[str]:
    """Write the tokenizer into `folder`; return the file names written (empty: the model has none)."""
    if source.gguf_path is not None:
        return save_gguf_tokenizer(source, folder)
    model_path = source.path
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
        raise_if_interrupted()  # an interrupt inside transformers' imports can surface as an ImportError
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


def hf_tokenizer(source: ModelSource):
    """transformers' tokenizer of the model, or None when the model has none.

    A folder has none without tokenizer files; a GGUF file has none when transformers cannot build
    one from its metadata (no `tokenizer.ggml.model`, or a kind it does not know), which is logged.
    """
    from transformers import AutoTokenizer

    if source.gguf_path is None:
        names = ("tokenizer.json", "tokenizer.model", "vocab.json")
        if not any((source.path / name).is_file() for name in names):
            return None
        return AutoTokenizer.from_pretrained(str(source.path))
    try:
        return AutoTokenizer.from_pretrained(str(source.path), **source.pretrained_kwargs)
    except (OSError, ValueError, KeyError) as err:
        logger.warning(
            "transformers could not build a tokenizer from %s (%s): it will take token ids only",
            source.reference,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return None


def save_gguf_tokenizer(source: ModelSource, folder: Path) -> list[str]:
    """The tokenizer transformers builds from the GGUF file's metadata, and the generation config it implies."""
    from transformers import GenerationConfig

    tokenizer = hf_tokenizer(source)
    if tokenizer is None:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = {Path(f).name for f in tokenizer.save_pretrained(str(folder))}
    if "tokenizer.json" not in written or tokenizer_json_problem(folder / "tokenizer.json") is not None:
        raise UserInputError(
            f"transformers built a tokenizer from {source.reference} but wrote no usable tokenizer.json "
            f"(it wrote {', '.join(sorted(written))}): the runtime could not read text with it."
        )
    generation = GenerationConfig.from_model_config(source.gguf_config)  # what the loaded model carries
    if any(getattr(generation, f"{name}_token_id") is not None for name in ("bos", "eos", "pad")):
        generation.save_pretrained(str(folder))
        written.add("generation_config.json")
    return sorted(written)
