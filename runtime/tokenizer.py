"""Text in and out, with the `tokenizers` library alone (the export carries a tokenizer.json)."""

from __future__ import annotations

from pathlib import Path

from paradecode.graphs.errors import MissingDependencyError


class TextTokenizer:
    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise MissingDependencyError(
                f"reading text needs the tokenizers library: `pip install tokenizers` ({err})."
            ) from err
        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer adds (a BOS for Llama models).

        A rendered chat holds its special tokens already: encode it with `add_special_tokens=False`.
        """
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns verified token ids into text pieces, holding back incomplete UTF-8 sequences.

    Each step decodes only the tokens since the last emitted piece, plus the few before them that
    a tokenizer needs to place spaces right: constant work per token.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already emitted
        self.read = 0
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece
