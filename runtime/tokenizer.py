"""Text in and out, with the `tokenizers` library alone (the export carries a tokenizer.json).

A completion's text is what its tokens add to the prompt's text: decode(prompt + output) minus
decode(prompt), as Hugging Face's text-generation pipeline and vLLM return it. Decoding the output
alone is not the same: a SentencePiece tokenizer drops the leading space of the first token it
decodes (" time" after "Once upon a" decodes alone as "time"), which would glue the completion to
the prompt and hide a stop string such as " time" at its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from paradecode.graphs.errors import ManifestError, MissingDependencyError

# Prompt tokens a stream decodes before its first new token, so that the first piece has the text the
# whole decode gives it (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
CONTEXT_TOKENS = 5


class TextTokenizer:
    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise MissingDependencyError(
                f"reading text needs the tokenizers library: `pip install tokenizers` ({err})."
            ) from err
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for every malformed file
            reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            raise ManifestError(
                f"{path} is not a tokenizer the tokenizers library can read ({reason}). The export's tokenizer is "
                "broken: re-export the model."
            ) from err

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer adds (a BOS for Llama models).

        A rendered chat holds its special tokens already: encode it with `add_special_tokens=False`.
        Encoded as a batch of one: `encode_batch` releases the GIL while it works and `encode` does not (tokenizers
        0.23), which would stop every other Python thread, a server's event loop included, for a long prompt's time.
        """
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def completion(self, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
        """The text `ids` add after `prompt_ids`: decode(prompt + ids) minus decode(prompt)."""
        head = self.decode(prompt_ids)
        whole = self.decode([*prompt_ids, *ids])
        return whole[len(head) :] if whole.startswith(head) else self.decode(ids)

    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes one vocabulary entry is spelled with (at least 1).

        A token's spelling (`▁time`, `Ġtime`) is at least as long in bytes as the text it stands for, so
        a text of more than `tokens * longest_token_bytes()` bytes cannot fit in `tokens` tokens (unless a
        normalizer deletes characters; callers leave a margin for that).
        """
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        return max((len(token.encode("utf-8")) for token in vocab), default=1) or 1


class TextStream:
    """Turns verified token ids into text pieces, holding back incomplete UTF-8 sequences.

    Each step decodes only the tokens since the last emitted piece, plus the few before them that
    a tokenizer needs to place spaces right: constant work per token. The pieces concatenate to
    `tokenizer.completion(prompt_ids, ids)`: the first one keeps the space a whole decode gives it,
    because the stream starts from the prompt's last tokens.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        if context and not tokenizer.decode(context):  # special tokens only: their text is empty
            context = list(prompt_ids)  # once, so the first piece is placed as after the whole prompt
        self.ids: list[int] = context
        self.prefix = 0  # ids[prefix:read] decode to text already emitted (or to the prompt's context)
        self.read = len(context)
        self.text = ""  # every piece emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        return self._emit(after[len(before) :])

    def finish(self) -> str:
        """The text held back at the end (an incomplete UTF-8 sequence, decoded as U+FFFD), once no token follows."""
        if self.read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        return self._emit(after[len(before) :] if after.startswith(before) else "")

    def _emit(self, piece: str) -> str:
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece
