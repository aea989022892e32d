"""The tiny GGUF files' tokenizer: a byte-level BPE ("gpt2") with every byte, a few merges, three
control tokens and a ChatML chat template, written as llama.cpp's `tokenizer.*` metadata."""

from __future__ import annotations

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġt", "he"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "s"),
    ("a", "t"),
    ("Ġ", "f"),
    ("d", "e"),
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS_ID, EOS_ID = 1, 2


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the alphabet of a byte-level BPE vocabulary)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types (3 control, 1 normal) and merges."""
    tokens = [*SPECIALS, *bytes_to_unicode().values(), *(a + b for a, b in MERGES)]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


VOCAB_SIZE = len(vocabulary()[0])


def write_tokenizer(writer, add_bos: bool, chat_template: str = CHAT_TEMPLATE) -> None:
    """The `tokenizer.*` keys llama.cpp's converter writes for a byte-level BPE with a chat template."""
    tokens, types, merges = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(chat_template)
