"""Chat templates without transformers: render `messages` exactly as `apply_chat_template` does.

An export's `tokenizer/` folder holds the model's chat template (`chat_template.jinja`, or a
`chat_template` entry in `tokenizer_config.json`) and its special tokens. `ChatTemplate.render`
gives the same text as transformers'
`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`: the same
sandboxed jinja2 environment (`ImmutableSandboxedEnvironment`, `trim_blocks`, `lstrip_blocks`,
loop controls, the `{% generation %}` tag), the same functions and filters (`raise_exception`,
`strftime_now`, `dict`, a `namespace` that refuses underscore names, a `tojson` that does not
escape HTML) and the same variables (`messages`, `tools`, `documents`, `add_generation_prompt`,
and every named special token: `bos_token`, `eos_token`, ...). Mirrors transformers 5.x
`utils/chat_template_utils.py`.

A rendered chat already holds the special tokens the model expects, so its token ids are the
tokenizer's ids of the text *without* added special tokens (transformers encodes it with
`add_special_tokens=False`).

The template is code from the model's authors and the messages come from users: the sandbox refuses
attribute escapes (`''.__class__...`) and `chat_sandbox` bounds the work of parsing and compiling (a
template's bytes and tokens; nothing is evaluated) and rendering. A template's own refusal
(`raise_exception`, on a role it does not know, say) is the user's error (UserInputError); every
other failure is the export's (ManifestError): an unsafe template, one that does not compile, uses
`{% include %}`, goes past a bound, fails on checked messages or renders nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from paradecode.graphs.errors import ManifestError, UserInputError
from paradecode.graphs.manifest import TOKENIZER_DIR
from paradecode.runtime.chat_sandbox import (
    MAX_TEMPLATE_BYTES,
    BoundedSandbox,
    TemplateBoundError,
    refused_statements,
    render,
)

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
LEGACY_SPECIAL_TOKENS_FILE = "special_tokens_map.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens a template sees by name.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_FILE_BYTES = 64 << 20  # tokenizer configs of large vocabularies run to a few MiB
MESSAGE_KEYS = ("role", "content")
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})  # besides the tokens
MESSAGE_FORMAT = 'a dict {"role": "...", "content": "..."} with string values'
# What compiling or rendering a template can raise besides jinja's own errors; every one is the template's fault.
RENDER_ERRORS = (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError)


class ChatTemplate:
    """A compiled chat template with the special tokens it may refer to.

    `ChatTemplate(source, special_tokens, origin)`; `origin` names where the source came from, for
    error messages. A template that does not compile raises ManifestError here, not at first use.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = "chat template"):
        if not isinstance(source, str):
            raise UserInputError(
                f"{origin}: a chat template is a string of jinja2 source, got {type(source).__name__}."
            )
        tokens = dict(special_tokens or {})
        bad = {k: v for k, v in tokens.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise UserInputError(f"{origin}: special tokens must map names to strings, got {bad!r}.")
        clash = sorted(tokens.keys() & TEMPLATE_VARIABLES)
        if clash:
            raise ManifestError(f"{origin}: special tokens may not be named {clash}: the template's own variables.")
        self.source = source
        self.special_tokens = tokens
        self.origin = origin
        self._template = _compiled(source, origin)

    @classmethod
    def from_folder(cls, folder: str | Path, names: frozenset[str] | None = None) -> ChatTemplate | None:
        """The chat template of a tokenizer folder, or None where it has none.

        `names`: the file names that may be read (an export reads only what its manifest lists);
        None: any file in the folder. `chat_template.jinja` wins over the config's entry, as in
        transformers.
        """
        folder = Path(folder)
        present = lambda name: (names is None or name in names) and (folder / name).is_file()
        config = _read_json(folder / CONFIG_FILE) if present(CONFIG_FILE) else {}
        if present(TEMPLATE_FILE):
            source, origin = _read_text(folder / TEMPLATE_FILE, MAX_TEMPLATE_BYTES), str(folder / TEMPLATE_FILE)
        else:
            source, origin = _template_of_config(config, folder / CONFIG_FILE), f"{folder / CONFIG_FILE} chat_template"
        if source is None:
            return None
        legacy = {}
        if "added_tokens_decoder" not in config and present(LEGACY_SPECIAL_TOKENS_FILE):
            legacy = _read_json(folder / LEGACY_SPECIAL_TOKENS_FILE)  # transformers merges it only then
        return cls(source, special_tokens_of(config, legacy, folder), origin)

    @classmethod
    def from_export(cls, export) -> ChatTemplate | None:
        """The chat template of an export (a runtime `ExportFolder`), from the files its manifest lists."""
        prefix = f"{TOKENIZER_DIR}/"
        names = frozenset(name[len(prefix) :] for name in export.manifest.tokenizer if name.startswith(prefix))
        return cls.from_folder(export.path / TOKENIZER_DIR, names)

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The chat as the model reads it, ending with the assistant's header when `add_generation_prompt`."""
        messages = check_messages(messages)
        try:
            text = render(
                self._template,
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=bool(add_generation_prompt),
                **self.special_tokens,
            )
        except TemplateRefusal as err:  # the template's own check of the messages: the client's mistake
            raise UserInputError(f"the chat template refused these messages: {err}") from err
        except jinja2.exceptions.SecurityError as err:
            raise ManifestError(
                f"{self.origin} tried an operation the sandbox forbids ({err}): the template is unsafe or broken. "
                "Fix the model's chat template and re-export, or pass plain prompts."
            ) from err
        except RENDER_ERRORS as err:  # messages are checked above: a failure past them is the template's
            raise ManifestError(
                f"{self.origin} failed while rendering a chat ({type(err).__name__}: {_reason(err)}): the model's "
                "chat template is broken. Fix it and re-export, or pass plain prompts."
            ) from err
        if not text:
            raise ManifestError(
                f"{self.origin} rendered nothing for {len(messages)} message(s) (every name it printed is undefined?): "
                "the model's chat template is broken. Fix it and re-export, or pass plain prompts."
            )
        return text


def check_messages(messages: Any) -> list[dict[str, str]]:
    """`messages` as plain dicts of strings, or a UserInputError naming the first bad message and why."""
    if not isinstance(messages, list):
        raise UserInputError(f"messages must be a list of messages, each {MESSAGE_FORMAT}; got {_describe(messages)}.")
    if not messages:
        raise UserInputError(f"messages is empty: give at least one message, {MESSAGE_FORMAT}.")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserInputError(f"messages[{i}] is {_describe(message)}; expected {MESSAGE_FORMAT}.")
        missing = [k for k in MESSAGE_KEYS if k not in message]
        extra = sorted(map(str, message.keys() - set(MESSAGE_KEYS)))
        if missing or extra:
            raise UserInputError(
                f"messages[{i}] has keys {sorted(map(str, message))}; expected exactly 'role' and 'content' "
                f"({'missing ' + ', '.join(missing) if missing else 'remove ' + ', '.join(extra)})."
            )
        for key in MESSAGE_KEYS:
            if not isinstance(message[key], str):
                raise UserInputError(f"messages[{i}]['{key}'] is {_describe(message[key])}; expected a string.")
        # Plain str copies: a str subclass could carry methods the sandbox does not know are unsafe.
        plain.append({key: str.__str__(message[key]) for key in MESSAGE_KEYS})
    return plain


def special_tokens_of(config: dict, legacy: dict, folder: Path) -> dict[str, str]:
    """The named special tokens a template sees: `tokenizer_config.json`'s, then `special_tokens_map.json`'s.

    A token is a string or an AddedToken dict (`{"content": "<s>", ...}`); model-specific tokens come
    from an `extra_special_tokens` dict (`{"image_token": "<image>"}`).
    """
    found: dict[str, str] = {}
    for source, where in ((config, CONFIG_FILE), (legacy, LEGACY_SPECIAL_TOKENS_FILE)):
        values = {name: source.get(name) for name in SPECIAL_TOKEN_NAMES}
        extra = source.get("extra_special_tokens")
        if isinstance(extra, dict):  # a list holds unnamed tokens, which templates cannot refer to
            values.update(extra)
        for name, value in values.items():
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                continue
            if not isinstance(value, str):
                raise ManifestError(
                    f"{folder / where}: {name} is {_describe(value)}; expected a string or an object with a "
                    'string "content". Fix the tokenizer files and re-export.'
                )
            found[name] = value
    return found


class TemplateRefusal(jinja2.TemplateError):
    """`raise_exception(message)` in a template: it refuses the messages it was given."""


def _raise_exception(message):
    raise TemplateRefusal(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' version: jinja's own escapes HTML characters, which would change the rendered text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in templates: makes plain dicts, exposes nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (no reaching into CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}."
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers marks assistant tokens with it)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.wrap_filters()
    return env


def _compiled(source: str, origin: str) -> jinja2.Template:
    """`source` compiled with bounded work (see chat_sandbox), or a ManifestError that says why not."""
    fix = "The model's chat template is broken: fix it in its tokenizer files and re-export, or pass plain prompts."
    env = _environment()
    try:
        ast = env.parse(source)
        refused = refused_statements(ast)
        if refused:
            raise ManifestError(
                f"{origin} uses {', '.join(refused)}, which a chat template cannot (it has no other templates to "
                f"load). {fix}"
            )
        return env.from_string(ast)
    except jinja2.TemplateSyntaxError as err:
        raise ManifestError(f"{origin} does not compile (line {err.lineno}: {err.message}). {fix}") from err
    except TemplateBoundError as err:  # refused before the work that grows with it (chat_sandbox)
        raise ManifestError(f"{origin} is refused before compiling: {err}. {fix}") from err
    except RENDER_ERRORS as err:  # e.g. an integer literal too long to read, a nesting too deep to parse
        raise ManifestError(f"{origin} does not compile ({type(err).__name__}: {_reason(err)}). {fix}") from err


def _reason(err: BaseException) -> str:
    text = str(err)
    return text if len(text) <= 300 else text[:300] + "..."


def _template_of_config(config: dict, path: Path) -> str | None:
    """The config's `chat_template`: a string, or a list of named templates of which "default" is used."""
    entry = config.get("chat_template")
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in entry):
        named = {t.get("name"): t["template"] for t in entry}
        if "default" in named:
            return named["default"]
        raise ManifestError(
            f"{path}: chat_template holds the named templates {sorted(map(str, named))} but no 'default' one, "
            "and paradecode renders the default template only."
        )
    raise ManifestError(
        f'{path}: chat_template is {_describe(entry)}; expected a string or a list of {{"name", "template"}} objects.'
    )


def _read_text(path: Path, limit: int = MAX_FILE_BYTES) -> str:
    size = path.stat().st_size
    if size > limit:
        raise ManifestError(
            f"{path} has {size:,} bytes, more than the {limit >> 20} MiB allowed for it: the file is broken or not "
            "what its name says. Fix it and re-export."
        )
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}).") from err


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path} is not JSON ({err.msg} at line {err.lineno}). Fix it and re-export.") from err
    except RecursionError as err:
        raise ManifestError(f"{path} nests its JSON too deeply to read. Fix it and re-export.") from err
    if not isinstance(value, dict):
        raise ManifestError(f"{path} holds {_describe(value)}; expected a JSON object.")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
