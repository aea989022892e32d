"""Chat templates: the runtime renders and tokenizes a chat exactly as transformers' apply_chat_template does.

Tokenizers are built in-process with the `tokenizers` library (a byte-level BPE trained on a few lines,
and a word-level vocabulary) and saved with transformers' `PreTrainedTokenizerFast`, so each folder is
shaped like an export's `tokenizer/`. Every rendering is compared with transformers on the same folder,
text and token ids.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from paradecode.graphs.errors import ManifestError, UserInputError
from paradecode.runtime import cli, load
from paradecode.runtime.chat import ChatTemplate, check_messages
from paradecode.runtime.tokenizer import TextTokenizer

# SmolLM2-135M-Instruct's template (ChatML with a default system prompt), as its chat_template.jinja holds it.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n"
    "' + message['content'] + '<|im_end|>' + '\n"
    "'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n"
    "' }}{% endif %}"
)

# Llama 3 style: a BOS written by the template, a default system prompt, trimmed contents.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mistral style: refuses an unknown role with raise_exception.
STRICT = """{{ bos_token }}{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('Unknown role: ' + message['role']) }}
{% endif %}
{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]
{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}
{% endfor %}"""

# tojson (no HTML escaping, keyword options), namespace, loop controls, dict(), the generation tag.
FEATURES = """{% set ns = namespace(users=0, first=none) %}
{% for message in messages %}
  {% if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
  {% if ns.first is none %}{% set ns.first = message.content %}{% endif %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  {% if message.role == 'system' %}{% continue %}{% endif %}
<{{ message.role }}>{{ message | tojson }}
{{ message.content | tojson(indent=2, sort_keys=true) }}
  {% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% endif %}
{% endfor %}
{{ dict(users=ns.users, first=ns.first) | tojson(separators=(',', ':')) }}
{% if add_generation_prompt %}<assistant>{% endif %}
{% if tools is none and documents is none %}no tools{% endif %}"""

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
STRICT_SPECIALS = ["<unk>", "<s>", "</s>"]

CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "You are a helpful assistant.",
    "system user assistant",
    "What is two plus two? It is four.",
    'Quote <b>this</b> & "that", café ünïcode ✓',
    "def add(a, b):\n    return a + b",
    "Once upon a time there was a little robot.",
]

CHATS = {
    "one user turn": [{"role": "user", "content": "What is two plus two?"}],
    "system and turns": [
        {"role": "system", "content": "  Answer in one word.  "},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "def add(a, b):\n    return a + b"},
    ],
    "odd characters": [{"role": "user", "content": 'Quote <b>this</b> & "that", café ✓ \U0001f600'}],
    "empty content": [{"role": "user", "content": ""}],
}


def bpe_tokenizer(specials: list[str], bos: str | None):
    """A byte-level BPE (the kind Llama 3, Qwen and SmolLM use) trained on CORPUS; a BOS post-processor if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def wordlevel_tokenizer(specials: list[str], bos: str | None):
    """A word-level vocabulary with a BOS post-processor (unknown words become <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for line in CORPUS for w in line.replace("\n", " ").split()} | {"[INST]", "[/INST]", "four"})
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def save_tokenizer(folder: Path, tok, template: str | None, **special_tokens) -> Path:
    """`tok` saved by transformers into `folder`, with `template` and the named special tokens."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special_tokens)
    fast.save_pretrained(folder)
    return folder


def hf_render(folder: Path, messages) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    return text, list(ids)


def ours(folder: Path, messages) -> tuple[str, list[int]]:
    """What the runtime renders and feeds the model (the model's chat path encodes this way)."""
    text = ChatTemplate.from_folder(folder).render(messages)
    return text, TextTokenizer(folder / "tokenizer.json").encode(text, add_special_tokens=False)


TEMPLATES = {
    "smollm2": (
        SMOLLM2,
        CHATML_SPECIALS,
        dict(bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"),
    ),
    "llama3": (LLAMA3, LLAMA3_SPECIALS, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")),
    "features": (FEATURES, CHATML_SPECIALS, dict(eos_token="<|im_end|>")),
}


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_and_ids_equal_transformers(tmp_path, name, chat):
    template, specials, tokens = TEMPLATES[name]
    bos = tokens.get("bos_token")
    folder = save_tokenizer(tmp_path / "tok", bpe_tokenizer(specials, bos), template, **tokens)
    text, ids = ours(folder, CHATS[chat])
    hf_text, hf_ids = hf_render(folder, CHATS[chat])
    assert text == hf_text
    assert ids == hf_ids
    if bos is not None:  # the post-processor's BOS is not added on top of the one the template wrote
        bos_id = TextTokenizer(folder / "tokenizer.json").encode("x")[0]
        assert ids.count(bos_id) == text.count(bos) >= 1


def test_the_plain_prompt_path_still_adds_the_bos(tmp_path):
    folder = save_tokenizer(tmp_path / "tok", bpe_tokenizer(LLAMA3_SPECIALS, "<|begin_of_text|>"), LLAMA3)
    tokenizer = TextTokenizer(folder / "tokenizer.json")
    assert tokenizer.encode("hi")[0] == tokenizer.encode("<|begin_of_text|>", add_special_tokens=False)[0]
    assert len(tokenizer.encode("hi")) == len(tokenizer.encode("hi", add_special_tokens=False)) + 1


def test_word_level_tokenizer_and_strict_template(tmp_path):
    tokens = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    folder = save_tokenizer(tmp_path / "tok", wordlevel_tokenizer(STRICT_SPECIALS, "<s>"), STRICT, **tokens)
    chat = CHATS["system and turns"]
    assert ours(folder, chat) == hf_render(folder, chat)
    assert ours(folder, chat)[1][0] == 1 and ours(folder, chat)[1].count(1) == 1  # one <s>


def test_raise_exception_is_the_users_error(tmp_path):
    import jinja2

    folder = save_tokenizer(tmp_path / "tok", wordlevel_tokenizer(STRICT_SPECIALS, "<s>"), STRICT, bos_token="<s>")
    bad = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    with pytest.raises(UserInputError, match="the chat template refused these messages: Unknown role: tool"):
        ChatTemplate.from_folder(folder).render(bad)
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):  # transformers refuses them too
        hf_render(folder, bad)


def test_template_from_the_config_entry_and_file_priority(tmp_path):
    folder = save_tokenizer(tmp_path / "tok", bpe_tokenizer(CHATML_SPECIALS, None), SMOLLM2, eos_token="<|im_end|>")
    chat = CHATS["system and turns"]
    # The template as a tokenizer_config.json entry (older exports), with special tokens as AddedToken objects.
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ eos_token }}|" + SMOLLM2
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ours(folder, chat) == hf_render(folder, chat)
    assert ours(folder, chat)[0].startswith("<|im_end|>|<|im_start|>system")
    # A list of named templates: the default one.
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "D{{ 1 }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ours(folder, chat)[0] == hf_render(folder, chat)[0] == "D1"
    # chat_template.jinja wins over the config's entry.
    (folder / "chat_template.jinja").write_text("F{{ messages | length }}")
    assert ours(folder, chat)[0] == hf_render(folder, chat)[0] == "F4"
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}]
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestError, match="named templates \\['tool_use'\\] but no 'default' one"):
        ChatTemplate.from_folder(folder)


def test_special_tokens_from_the_legacy_map_and_model_specific_names(tmp_path):
    template = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ image_token }}"
    tok = bpe_tokenizer(LLAMA3_SPECIALS, "<|begin_of_text|>")
    folder = save_tokenizer(tmp_path / "tok", tok, template, eos_token="<|eot_id|>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = {"image_token": "<|end_header_id|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    added = {
        "content": "<|begin_of_text|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }
    legacy = {"bos_token": added, "eos_token": "<|start_header_id|>", "pad_token": "<|eot_id|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(legacy))
    chat = CHATS["one user turn"]
    # special_tokens_map.json fills in and overrides the config's tokens...
    assert ours(folder, chat) == hf_render(folder, chat)
    assert ours(folder, chat)[0] == "<|begin_of_text|>|<|start_header_id|>|<|eot_id|>|<|end_header_id|>"
    # ...unless the config lists its added tokens itself (what transformers has written for years).
    config["added_tokens_decoder"] = {
        str(tok.token_to_id(t)): dict(added, content=t, special=True) for t in LLAMA3_SPECIALS
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ours(folder, chat) == hf_render(folder, chat)
    assert ours(folder, chat)[0] == "|<|eot_id|>||<|end_header_id|>"


def test_a_folder_without_a_template(tmp_path):
    folder = save_tokenizer(tmp_path / "tok", bpe_tokenizer(CHATML_SPECIALS, None), None, eos_token="<|im_end|>")
    assert not (folder / "chat_template.jinja").exists()
    assert ChatTemplate.from_folder(folder) is None
    assert ChatTemplate.from_folder(tmp_path / "empty") is None


def test_broken_template_files(tmp_path):
    with pytest.raises(ManifestError, match=r"does not compile \(line 1: .*re-export"):
        ChatTemplate("{% for m in messages %}{{ m.content }")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ManifestError, match="tokenizer_config.json is not JSON"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ManifestError, match="chat_template is int 3; expected a string or a list"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x", "bos_token": ["<s>"]}))
    with pytest.raises(ManifestError, match="bos_token is list .*expected a string or an object"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "x", "extra_special_tokens": {"tools": "t"}})
    )
    with pytest.raises(ManifestError, match=r"special tokens may not be named \['tools'\]"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe")
    with pytest.raises(ManifestError, match="chat_template.jinja is not UTF-8 text"):
        ChatTemplate.from_folder(tmp_path)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ messages.append(messages[0]) }}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ namespace(_secret=1) }}",
    ],
)
def test_sandbox_escapes_fail_cleanly(template):
    with pytest.raises(ManifestError, match="tried an operation the sandbox forbids"):
        ChatTemplate(template).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "template", ["{{ ''.__class__ }}", "{{ raise_exception.__globals__ }}", "{{ dict.__class__ }}"]
)
def test_unsafe_attributes_render_as_nothing(template):
    """jinja's sandbox makes a lone unsafe attribute undefined (empty), as transformers does: nothing leaks."""
    assert ChatTemplate("[" + template + "]").render([{"role": "user", "content": "hi"}]) == "[]"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", r"messages must be a list of messages, each a dict .*got str 'hello'"),
        ({"role": "user", "content": "hi"}, r"messages must be a list .*got a dict with keys \['content', 'role'\]"),
        ([], "messages is empty: give at least one message"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] is str 'b'; expected a dict"),
        (
            [{"role": "user"}],
            r"messages\[0\] has keys \['role'\]; expected exactly 'role' and 'content' \(missing content\)",
        ),
        ([{"role": "user", "content": "a", "name": "x"}], r"messages\[0\] has keys .* \(remove name\)"),
        ([{"role": 3, "content": "a"}], r"messages\[0\]\['role'\] is int 3; expected a string"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] is NoneType None; expected a string"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], r"messages\[0\]\['content'\] is list"),
    ],
)
def test_messages_are_checked(messages, message):
    with pytest.raises(UserInputError, match=message):
        check_messages(messages)
    with pytest.raises(UserInputError, match=message):
        ChatTemplate(SMOLLM2).render(messages)


def test_checked_messages_are_plain_copies():
    class Text(str):
        pass

    given = [{"role": Text("user"), "content": Text("hi")}]
    checked = check_messages(given)
    assert checked == [{"role": "user", "content": "hi"}] and checked[0] is not given[0]
    assert type(checked[0]["role"]) is str and type(checked[0]["content"]) is str


# --- an export whose tokenizer has a chat template ------------------------------------------------------------------

CHAT_MODEL_TOKENS = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory):
    """(export folder, model folder): a tiny random Llama with a Llama 3 style tokenizer and chat template.

    Its tokenizer adds a BOS to every encoding and its template writes one too: the chat path must not double it.
    """
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model
    from tests.tiny_models import TINY_CONFIGS, tiny_model

    model_dir = tmp_path_factory.mktemp("chat-model")
    tok = bpe_tokenizer(LLAMA3_SPECIALS, "<|begin_of_text|>")
    save_tokenizer(model_dir, tok, LLAMA3, **CHAT_MODEL_TOKENS)
    config = dict(
        TINY_CONFIGS["llama"],
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<|begin_of_text|>"),
        eos_token_id=tok.token_to_id("<|eot_id|>"),
    )
    tiny_model("llama", configs={"llama": config}).save_pretrained(model_dir)
    out = tmp_path_factory.mktemp("chat-export") / "export"
    export_model(ExportConfig(model=str(model_dir), output=out, max_seq_len=96))
    return out, model_dir


def without_template(export: Path, target: Path) -> Path:
    """A copy of `export` whose tokenizer has no chat template (its manifest no longer lists the file)."""
    shutil.copytree(export, target)
    (target / "tokenizer" / "chat_template.jinja").unlink()
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["tokenizer"].remove("tokenizer/chat_template.jinja")
    del manifest["files"]["tokenizer/chat_template.jinja"]
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def with_file(export: Path, target: Path, relative: str, content: bytes) -> Path:
    """A copy of `export` whose file `relative` holds `content`, listed in its manifest with its hash and size
    (what a tampered or badly made export looks like once it passes the hash check)."""
    import hashlib

    shutil.copytree(export, target)
    (target / relative).write_bytes(content)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["files"][relative] = {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}
    if relative.startswith("tokenizer/") and relative not in manifest["tokenizer"]:
        manifest["tokenizer"].append(relative)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def test_generate_and_stream_with_messages(chat_export):
    folder, model_dir = chat_export
    assert "tokenizer/chat_template.jinja" in json.loads((folder / "manifest.json").read_text())["tokenizer"]
    chat = CHATS["system and turns"]
    text, ids = hf_render(model_dir, chat)
    with load(folder) as model:
        assert model.render_chat(chat) == text
        assert model.prompt_ids(messages=chat) == ids
        bos = model.manifest.model["bos_token_id"]
        assert ids.count(bos) == 1  # the template's; the tokenizer adds none on top
        expected = model.generate(prompt_ids=ids, mode="ar", max_new_tokens=6, ignore_eos=True)
        result = model.generate(messages=chat, mode="ar", max_new_tokens=6, ignore_eos=True)
        assert result.token_ids == expected.token_ids and result.stats.prompt_tokens == len(ids)
        with model.stream(messages=chat, max_new_tokens=6, thresholds=0.0, ignore_eos=True) as stream:
            assert [piece.token for piece in stream] == expected.token_ids
        # A plain prompt of the same text is a different request: it does not render the template.
        assert model.prompt_ids(text) == TextTokenizer(folder / "tokenizer" / "tokenizer.json").encode(text)


def test_generate_refuses_two_prompts_and_bad_messages(chat_export):
    folder, _ = chat_export
    chat = CHATS["one user turn"]
    with load(folder) as model:
        with pytest.raises(UserInputError, match="exactly one of .*; got prompt and messages"):
            model.generate("hi", messages=chat, max_new_tokens=2)
        with pytest.raises(UserInputError, match="exactly one of .*; got prompt_ids and messages"):
            model.stream(prompt_ids=[1, 2], messages=chat, max_new_tokens=2)
        with pytest.raises(UserInputError, match=r"messages\[0\]\['content'\] is int 5"):
            model.generate(messages=[{"role": "user", "content": 5}], max_new_tokens=2)
        with pytest.raises(UserInputError, match="more than the export's KV cache holds"):
            model.generate(messages=[{"role": "user", "content": "four " * 200}], max_new_tokens=2)
        assert model.generate(messages=chat, max_new_tokens=2, ignore_eos=True).stats.new_tokens == 2  # still usable


def test_an_export_without_a_template(chat_export, exports, tmp_path):
    folder = without_template(chat_export[0], tmp_path / "plain")
    chat = CHATS["one user turn"]
    with load(folder) as model:
        assert model.chat_template is None
        for call in (lambda: model.render_chat(chat), lambda: model.generate(messages=chat, max_new_tokens=2)):
            with pytest.raises(UserInputError, match="this export has no chat template: .*Pass a plain prompt instead"):
                call()
        assert model.generate("What is", max_new_tokens=2, ignore_eos=True).stats.new_tokens == 2
    with load(exports["llama"][0]) as model:  # no tokenizer at all
        assert model.chat_template is None
        with pytest.raises(UserInputError, match="has no tokenizer: send the prompt as a list of token ids"):
            model.generate(messages=chat, max_new_tokens=2)


def test_a_template_not_listed_in_the_manifest_is_not_read(chat_export, tmp_path):
    """Only the files the manifest lists (and hash-checks) are read: a template dropped in later is ignored."""
    folder = without_template(chat_export[0], tmp_path / "plain")
    (folder / "tokenizer" / "chat_template.jinja").write_text("INJECTED")
    with load(folder) as model:
        assert model.chat_template is None


# --- paradecode-generate ------------------------------------------------------------------------------------------


def run_cli(argv, capsys) -> tuple[int, dict | None, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_cli_messages_and_chat(chat_export, tmp_path, capsys):
    folder, model_dir = chat_export
    settings = ["--json", "--mode", "ar", "--max-new-tokens", "4", "--ignore-eos"]
    chat = CHATS["system and turns"]
    with load(folder) as model:
        expected = model.generate(
            prompt_ids=hf_render(model_dir, chat)[1], mode="ar", max_new_tokens=4, ignore_eos=True
        )
        one_turn = [{"role": "user", "content": "What is two plus two?"}]
        expected_turn = model.generate(messages=one_turn, mode="ar", max_new_tokens=4, ignore_eos=True)
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    (tmp_path / "request.json").write_text(json.dumps({"model": "x", "messages": chat}))
    for name in ("chat.json", "request.json"):
        code, out, _ = run_cli([str(folder), "--messages", str(tmp_path / name), *settings], capsys)
        assert code == 0 and out["token_ids"] == expected.token_ids
    code, out, _ = run_cli([str(folder), "--chat", "--prompt", "What is two plus two?", *settings], capsys)
    assert code == 0 and out["token_ids"] == expected_turn.token_ids
    (tmp_path / "prompt.txt").write_text("What is two plus two?")
    code, out, _ = run_cli([str(folder), "--chat", "--prompt-file", str(tmp_path / "prompt.txt"), *settings], capsys)
    assert code == 0 and out["token_ids"] == expected_turn.token_ids


def test_cli_refuses_bad_chat_options(chat_export, tmp_path, capsys):
    folder, _ = chat_export
    for argv in (["--chat", "--prompt-ids", "1,2"], ["--messages", "m.json", "--prompt", "hi"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main([str(folder), *argv])
        assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    cases = {
        "missing.json": (None, "--messages .*missing.json: no such file"),
        "bad.json": ("[{", r"--messages .*bad.json is not JSON \(.* at line 1, column 3\)"),
        "object.json": (
            '{"role": "user"}',
            'holds a JSON dict; expected a list of .* \\(or an object with a "messages"',
        ),
        "wrong.json": ('[{"role": "user", "content": 1}]', r"messages\[0\]\['content'\] is int 1; expected a string"),
    }
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        code, _, err = run_cli([str(folder), "--messages", str(tmp_path / name), "--max-new-tokens", "2"], capsys)
        assert code == 2, name
        assert re.search(message, err), (name, err)


def test_cli_chat_needs_text(chat_export, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(chat_export[0]), "--chat", "--prompt-ids", "1"])
    assert exit_.value.code == 2
    assert "--chat renders the text of --prompt or --prompt-file" in capsys.readouterr().err


def folded(constants: int) -> str:
    """`constants` constants that jinja's optimizer folds while compiling, inside `{% if false %}` (11 bytes each)."""
    return "{% if false %}" + "{{ 1 + 2 }}" * constants + "{% endif %}"


def huge_template_file(folder: Path, target: Path, template: str) -> Path:
    return with_file(folder, target, "tokenizer/chat_template.jinja", template.encode())


def huge_config_entry(folder: Path, target: Path, template: str) -> Path:
    plain = without_template(folder, target.with_name(target.name + "-plain"))
    config = json.loads((plain / "tokenizer" / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    return with_file(plain, target, "tokenizer/tokenizer_config.json", json.dumps(config).encode())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("where", "template", "message"),
    [  # the issue's: 4 MB of folded constants took 86 s and 2.9 GB to load
        (huge_template_file, folded(363_000), "chat_template.jinja has 3,993,025 bytes, more than the 1 MiB allowed"),
        (  # 660 KB: under the bytes' bound, past the tokens'
            huge_template_file,
            folded(60_000),
            "chat_template.jinja is refused before compiling: the template has more than 50,000 tokens",
        ),
        (
            huge_config_entry,
            "{# #}" + " " * (1 << 20),
            "chat_template is refused before compiling: the template has 1,048,581 bytes, more than the 1 MiB",
        ),
    ],
    ids=["file, 4 MB", "file, tokens", "config entry, bytes"],
)
def test_cli_refuses_a_huge_chat_template_at_once(chat_export, tmp_path, capsys, where, template, message):
    folder = where(chat_export[0], tmp_path / "huge", template)
    started = time.monotonic()
    code, _, err = run_cli([str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "1", "--json"], capsys)
    assert code == 2 and "paradecode-generate: error: " in err and message in err, err
    assert time.monotonic() - started < 10


# --- prompt files in the tools ------------------------------------------------------------------------------------


def write_jsonl(path: Path, prompts: list) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": p} if isinstance(p, str) else {"messages": p}) + "\n" for p in prompts)
    )
    return path


def test_bench_turns_chat_prompts_into_the_templates_ids(chat_export, tmp_path):
    from paradecode.export.prompt_files import read_prompts
    from paradecode.tools.bench import prompt_ids_of

    folder, model_dir = chat_export
    chat = CHATS["system and turns"]
    prompts = read_prompts(write_jsonl(tmp_path / "p.jsonl", ["Once upon a time", chat]))
    with load(folder) as model:
        ids = prompt_ids_of(model, prompts)
        assert ids == [model.tokenizer.encode("Once upon a time"), hf_render(model_dir, chat)[1]]
    with (
        load(without_template(folder, tmp_path / "plain")) as model,
        pytest.raises(UserInputError, match="prompt 2 \\(of 2\\): this export has no chat template"),
    ):
        prompt_ids_of(model, prompts)


def test_train_heads_turns_chat_prompts_into_the_templates_ids(chat_export, tmp_path):
    from transformers import AutoTokenizer

    from paradecode.export.heads.pipeline import prompt_ids_of
    from paradecode.export.prompt_files import read_prompts

    _, model_dir = chat_export
    chat = CHATS["system and turns"]
    prompts = read_prompts(write_jsonl(tmp_path / "p.jsonl", ["Once upon a time", chat]))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = prompt_ids_of(tokenizer, prompts, "tiny")
    assert ids == [tokenizer("Once upon a time")["input_ids"], hf_render(model_dir, chat)[1]]
    assert ids[1] == ours(model_dir, chat)[1]  # the runtime agrees with the tool

    strict = save_tokenizer(tmp_path / "strict", wordlevel_tokenizer(STRICT_SPECIALS, "<s>"), STRICT, bos_token="<s>")
    with pytest.raises(
        UserInputError, match="prompt 1 \\(of 1\\): the chat template of tiny refused .*Unknown role: x"
    ):
        prompt_ids_of(AutoTokenizer.from_pretrained(str(strict)), [[{"role": "x", "content": "a"}]], "tiny")
    plain = save_tokenizer(tmp_path / "plain", wordlevel_tokenizer(STRICT_SPECIALS, "<s>"), None, bos_token="<s>")
    with pytest.raises(UserInputError, match="prompt 2 \\(of 2\\) is a chat, but the tokenizer of tiny has no chat"):
        prompt_ids_of(AutoTokenizer.from_pretrained(str(plain)), prompts, "tiny")


# --- templates and tokenizers from an untrusted export: bounded work, and the export's error ------------------------

ONE_TURN = [{"role": "user", "content": "hi"}]


@pytest.mark.timeout(30)  # a regression hangs (constant folding of 9**(9**9) never ends)
@pytest.mark.parametrize(
    ("template", "when", "message"),
    [
        ("{% if false %}{{ 9**(9**9) }}{% endif %}ok", None, None),  # folded while compiling, before
        ("{{ 9**(9**9) }}", "render", r"9 \*\* 387420489 has more than 4096 bits"),
        ("{{ 10**5000 }}", "render", "more than 4096 bits"),  # was a bare ValueError (too long to print)
        ("{{ " + "1" * 5000 + " }}", "load", "does not compile \\(ValueError: Exceeds the limit"),
        ("{{ " + "(" * 20_000 + "1" + ")" * 20_000 + " }}", "load", "does not compile \\(RecursionError"),
        ("{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", "load", "refused before compiling: .* 50,000 tokens"),
        ("{% include 'other.jinja' %}", "load", r"uses \{% include %\} \(line 1\)"),
        ("x{% import 'macros' as m %}", "load", r"uses \{% import %\}"),
        ("{% extends 'base' %}", "load", r"uses \{% extends %\}"),
        ("{{ bos_tokn }}{{ mesages }}", "render", "rendered nothing for 1 message"),
        ("{{ 'a' * 10**9 }}", "render", "repeating 1 items 1000000000 times"),
        ("{{ 'a' | center(10**9) }}", "render", "the filter center got the integer 1000000000"),
        ("{{ '%0999999999d' % 1 }}", "render", "asks for a width beyond"),
        ("{{ '{:999999999}'.format(1) }}", "render", "asks for a width beyond"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "render", "range"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "render",
            "a concatenation of more than",
        ),
        ("{% for i in range(100) %}{{ 'x'.ljust(10**6) }}{% endfor %}", "render", "rendered more than"),
        ("{{ messages[3].content }}", "render", "UndefinedError: list object has no element 3"),
        ("{{ 1 / 0 }}", "render", "ZeroDivisionError"),
    ],
)
def test_templates_compile_with_bounded_work_and_fail_as_the_exports_error(template, when, message):
    if when is None:
        assert ChatTemplate(template).render(ONE_TURN) == "ok"
        return
    if when == "load":
        with pytest.raises(ManifestError, match=message):
            ChatTemplate(template)
        return
    compiled = ChatTemplate(template)
    with pytest.raises(ManifestError, match=f"{message}.*chat template is broken"):
        compiled.render(ONE_TURN)


def test_bounded_templates_still_do_ordinary_work():
    template = (
        "{{ messages[0].content }} {{ 2**10 }} {{ 'ab' * 3 }} {{ '%5d' % 3 }} {{ '{:>4}'.format('a') }} "
        "{{ 'x' | center(5) }} {{ range(3) | list }} {{ (messages | length) // 1 }}"
    )
    assert ChatTemplate(template).render(ONE_TURN) == "hi 1024 ababab     3    a   x   [0, 1, 2] 1"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("relative", "content", "message"),
    [
        ("tokenizer/tokenizer.json", b"{not json", "tokenizer.json is not a tokenizer the tokenizers library"),
        (
            "tokenizer/tokenizer.json",
            b'{"model": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}",
            "recursion limit exceeded",
        ),
        ("tokenizer/tokenizer_config.json", b"[" * 100_000 + b"]" * 100_000, "nests its JSON too deeply"),
        ("tokenizer/chat_template.jinja", b"{% include 'x' %}", r"uses \{% include %\}"),
    ],
)
def test_broken_tokenizer_files_are_manifest_errors_and_exit_2(
    chat_export, tmp_path, capsys, relative, content, message
):
    folder = with_file(chat_export[0], tmp_path / "broken", relative, content)
    with pytest.raises(ManifestError, match=message):
        load(folder)
    assert cli.main([str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
