"""Prompt files, read in one place for every tool (`--prompts FILE`).

Two formats, told apart by the file's suffix:

- text (any suffix but `.jsonl`): one prompt per line, `\\n` (a backslash and an n) for a newline
  inside a prompt; blank lines are skipped.
- JSON Lines (`.jsonl`): one object per line, either `{"prompt": "text"}` or
  `{"messages": [{"role": "user", "content": "text"}, ...]}` (a chat, as the OpenAI API takes it),
  with an optional `"category": "name"` (a non-empty string: the benchmark reports per category);
  other keys are ignored, blank lines skipped.

`read_prompts` returns each prompt as its text or its list of messages; a tool renders messages with
the model's chat template (`paradecode-bench` with the export's, `paradecode-train-heads` with the
tokenizer's). `read_labelled_prompts` returns them with their categories (None where a line has none,
and for text files). `read_text_prompts` is for tools that take text only: it refuses chats with a
clear error. The project's own prompt sets, by name, are in `paradecode.export.prompt_sets`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paradecode.graphs.errors import UserInputError

Messages = list[dict[str, str]]
Prompt = str | Messages  # the text, or a chat's messages

MAX_FILE_BYTES = 64 << 20  # prompt files are small; a larger one is a wrong path
TEXT_FORMAT = "one prompt per line (\\n for a newline inside a prompt)"
JSONL_LINE = (
    'one JSON object per line: {"prompt": "text"} or {"messages": [{"role": "user", "content": "text"}]}, '
    'optionally with "category": "name"'
)


@dataclass(frozen=True)
class LabelledPrompt:
    """A prompt and the category it belongs to (None: no category given)."""

    prompt: Prompt
    category: str | None = None


def read_text_file(path: Path | str, option: str) -> str:
    """The UTF-8 text of `path` (at most MAX_FILE_BYTES), or a UserInputError naming `option`."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "no such file"
        raise UserInputError(f"{option} {path}: {what}; expected a text file.")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise UserInputError(f"{option} {path} has {size} bytes, more than the {MAX_FILE_BYTES >> 20} MiB allowed.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserInputError(
            f"{option} {path} is not UTF-8 text ({err.reason} at byte {err.start}): is it a binary file? Give a text "
            "file."
        ) from None


def read_prompts(path: Path | str) -> list[Prompt]:
    """The prompts in `path`: strings, or message lists from a `.jsonl` file's `"messages"` lines."""
    return [p.prompt for p in read_labelled_prompts(path)]


def read_labelled_prompts(path: Path | str) -> list[LabelledPrompt]:
    """The prompts in `path` with their categories (a `.jsonl` line's `"category"`, else None)."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"prompt file {path}: no such file (expected {_format(path)}).")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise UserInputError(
            f"prompt file {path} has {size} bytes, more than the {MAX_FILE_BYTES >> 20} MiB a prompt file may have: "
            "is it the right file?"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise UserInputError(f"prompt file {path} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    if path.suffix == ".jsonl":
        prompts = [_from_json(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    else:
        prompts = [LabelledPrompt(line.replace("\\n", "\n")) for line in lines if line.strip()]
    if not prompts:
        raise UserInputError(f"prompt file {path} has no prompts: expected {_format(path)}.")
    return prompts


def read_text_prompts(path: Path | str) -> list[str]:
    """The prompts in `path` as text, for a tool that takes no chats: a `"messages"` line is refused."""
    prompts = read_prompts(path)
    chats = [i for i, p in enumerate(prompts, 1) if not isinstance(p, str)]
    if chats:
        raise UserInputError(
            f'prompt file {path}: prompt {chats[0]} (of {len(prompts)}) is a chat ("messages"), and this tool '
            'takes text prompts only. Give its text as {"prompt": "..."} instead (paradecode-bench and '
            "paradecode-train-heads take chats)."
        )
    return [p for p in prompts if isinstance(p, str)]


def _format(path: Path) -> str:
    return JSONL_LINE if path.suffix == ".jsonl" else TEXT_FORMAT


def _from_json(path: Path, number: int, line: str) -> LabelledPrompt:
    where = f"prompt file {path}, line {number}"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserInputError(f"{where} is not JSON ({err.msg} at column {err.colno}); expected {JSONL_LINE}.") from None
    if not isinstance(value, dict) or len(value.keys() & {"prompt", "messages"}) != 1:
        raise UserInputError(f"{where}: got {_describe(value)}; expected {JSONL_LINE}.")
    category = value.get("category")
    if category is not None and (not isinstance(category, str) or not category.strip()):
        raise UserInputError(f'{where}: "category" is {_describe(category)}; expected a non-empty string.')
    return LabelledPrompt(_prompt_of(where, value), category)


def _prompt_of(where: str, value: dict[str, Any]) -> Prompt:
    if "prompt" in value:
        prompt = value["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserInputError(f'{where}: "prompt" is {_describe(prompt)}; expected a non-empty string.')
        return prompt
    messages = value["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserInputError(f'{where}: "messages" is {_describe(messages)}; expected a non-empty list of messages.')
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise UserInputError(
                f'{where}: message {i} is {_describe(message)}; expected {{"role": "...", "content": "..."}} '
                "with string values."
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)}"
    text = json.dumps(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
