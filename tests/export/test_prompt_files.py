"""Prompt files (export/prompt_files.py): text and JSON lines, and what they refuse."""

from __future__ import annotations

import json

import pytest

from paradecode.export import prompt_files
from paradecode.graphs.errors import UserInputError


def test_prompts_text_file(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("def f():\\n    return 1\n\n   \nOnce upon a time\n")
    assert prompt_files.read_prompts(path) == ["def f():\n    return 1", "Once upon a time"]
    assert prompt_files.read_text_prompts(path) == ["def f():\n    return 1", "Once upon a time"]


def test_prompts_jsonl_file(tmp_path):
    path = tmp_path / "p.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text(
        json.dumps({"prompt": "a\nb", "id": 7}) + "\n\n" + json.dumps({"messages": chat}) + "\n",
    )
    assert prompt_files.read_prompts(path) == ["a\nb", chat]
    with pytest.raises(UserInputError, match=r"prompt 2 \(of 2\) is a chat.*this tool takes text prompts only"):
        prompt_files.read_text_prompts(path)
    only_text = tmp_path / "t.jsonl"
    only_text.write_text('{"prompt": "x\\\\ny"}\n')  # JSON has its own escapes: no \n unescaping on top
    assert prompt_files.read_text_prompts(only_text) == ["x\\ny"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2 is not JSON \(.* at column 2\); expected one JSON object per line"),
        ('["a list"]', r"line 2: got list \[\"a list\"\]; expected one JSON object"),
        ('{"text": "x"}', r"line 2: got an object with keys \['text'\]; expected"),
        ('{"prompt": "x", "messages": []}', r"line 2: got an object with keys \['messages', 'prompt'\]"),
        ('{"prompt": 3}', r'line 2: "prompt" is int 3; expected a non-empty string'),
        ('{"prompt": "  "}', r'line 2: "prompt" is str "  "; expected a non-empty string'),
        ('{"messages": "hi"}', r'line 2: "messages" is str "hi"; expected a non-empty list of messages'),
        ('{"messages": [{"role": "user"}]}', r"line 2: message 0 is an object with keys \['role'\]; expected"),
    ],
)
def test_prompts_jsonl_refuses_a_malformed_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UserInputError, match=message) as err:
        prompt_files.read_prompts(path)
    assert str(path) in str(err.value)


def test_prompts_refuse_missing_empty_and_binary_files(tmp_path):
    with pytest.raises(UserInputError, match=r"none.txt: no such file \(expected one prompt per line"):
        prompt_files.read_prompts(tmp_path / "none.txt")
    with pytest.raises(UserInputError, match="no such file"):
        prompt_files.read_prompts(tmp_path)  # a folder
    for name in ("empty.txt", "empty.jsonl"):
        (tmp_path / name).write_text("\n  \n")
        with pytest.raises(UserInputError, match=f"{name} has no prompts: expected"):
            prompt_files.read_prompts(tmp_path / name)
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00x")
    with pytest.raises(UserInputError, match="is not UTF-8 text"):
        prompt_files.read_prompts(tmp_path / "binary.txt")


def test_prompts_refuse_a_huge_file(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_files, "MAX_FILE_BYTES", 10)
    (tmp_path / "big.txt").write_text("x" * 11)
    with pytest.raises(UserInputError, match="has 11 bytes, more than"):
        prompt_files.read_prompts(tmp_path / "big.txt")
