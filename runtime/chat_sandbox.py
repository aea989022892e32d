"""A jinja2 sandbox whose work is bounded, for chat templates (which come with an export: untrusted input).

jinja2's sandbox refuses unsafe attributes, but not unbounded work:

- parsing and compiling cost time and memory in proportion to a template's tokens (names, literals, operators,
  tags), about 15 us and 650 bytes each: a 4 MB template of folded constants took 86 s and 2.9 GB. So a template
  may have at most MAX_TEMPLATE_BYTES bytes and MAX_TEMPLATE_TOKENS tokens, counted as jinja lexes it and before
  it parses (`BoundedSandbox.parse`): real chat templates have tens of KB at most (gpt-oss's and Gemma's about
  16 KB: a few thousand tokens), and one at the bounds loads in about 1 s.
- compiling evaluates constants: the optimizer folds `{{ 9**(9**9) }}` even inside `{% if false %}`
  (a load that never ends), and `{{ 10**5000 }}` then fails to print (a bare ValueError). Here the
  optimizer is off and the code generator folds nothing (`_NoFolding`), so compiling only translates;
  the arithmetic operators are intercepted (jinja never folds an intercepted operator) and bounded
  when a render reaches them.
- `{% include %}`, `{% import %}` and `{% extends %}` need a loader; a chat template has none, and
  `refused_statements` names them at load instead of failing on every request.
- rendering (`render`) is bounded per render (`Budget`): an output of at most MAX_ITEMS characters,
  integers of at most MAX_INT_BITS bits, strings and lists of at most MAX_ITEMS items made by `+`,
  `*` and `%`, format widths of at most MAX_WIDTH, integer arguments to filters and calls of at
  most MAX_ITEMS, MAX_RANGE_ITEMS `range()` items in all, and RENDER_SECONDS of work, checked at
  every operator, call, filter, attribute and item access. A template that needs more is broken: `TemplateBoundError`.

This bounds what templates do through jinja's hooks; a Python string method called from a template
(`s.replace('', s)`) still runs to its end once called, within the arguments' bounds above.
"""

from __future__ import annotations

import functools
import re
import string
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import _PassArg

MAX_TEMPLATE_BYTES = 1 << 20  # a template's UTF-8 source
MAX_TEMPLATE_TOKENS = 50_000  # jinja's lexer tokens of a template (text between tags is one)
MAX_INT_BITS = 4096  # about 1,233 decimal digits (Python prints at most 4,300)
MAX_ITEMS = 1 << 25  # characters of a string, items of a list (32 Mi)
MAX_WIDTH = 10_000  # a format field's width or precision
MAX_RANGE_ITEMS = 1_000_000  # range() items of one render, every call together (jinja caps each call at 100,000)
RENDER_SECONDS = 5.0
INTERCEPTED = frozenset({"+", "*", "**", "%", "//"})
REFUSED_STATEMENTS = {
    jinja2.nodes.Include: "{% include %}",
    jinja2.nodes.Import: "{% import %}",
    jinja2.nodes.FromImport: "{% from ... import %}",
    jinja2.nodes.Extends: "{% extends %}",
}
PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class TemplateBoundError(jinja2.TemplateError):
    """A template went past one of this module's bounds."""


@dataclass
class Budget:
    """What one render may still do."""

    deadline: float = field(default_factory=lambda: time.monotonic() + RENDER_SECONDS)
    range_items: int = MAX_RANGE_ITEMS

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(f"rendering took more than {RENDER_SECONDS:g} s")


_budget: ContextVar[Budget | None] = ContextVar("paradecode_template_budget", default=None)


@contextmanager
def rendering() -> Iterator[Budget]:
    """A fresh budget for the renders inside the block (in this thread or task only)."""
    budget = Budget()
    token = _budget.set(budget)
    try:
        yield budget
    finally:
        _budget.reset(token)


def render(template: jinja2.Template, **variables) -> str:
    """`template` rendered under a fresh budget, its output at most MAX_ITEMS characters."""
    pieces, size = [], 0
    with rendering():
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_ITEMS:
                raise TemplateBoundError(f"the template rendered more than {MAX_ITEMS} characters")
            pieces.append(piece)
    return "".join(pieces)


def _spend() -> Budget:
    budget = _budget.get()
    if budget is None:
        raise TemplateBoundError("a chat template renders only inside rendering()")
    budget.check_time()
    return budget


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def _check_result(value: Any, what: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateBoundError(f"{what} makes an integer of more than {MAX_INT_BITS} bits")
    size = _size(value)
    if size is not None and size > MAX_ITEMS:
        raise TemplateBoundError(f"{what} makes a value of {size} items, more than {MAX_ITEMS}")
    return value


def _check_arguments(args: tuple, kwargs: dict, what: str) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ITEMS:
            raise TemplateBoundError(f"{what} got the integer {value}, more than {MAX_ITEMS}")


def _check_percent_format(text: str) -> None:
    for match in PERCENT_FIELD.finditer(text):
        for number in match.groups():
            if number == "*" or (number is not None and int(number) > MAX_WIDTH):
                raise TemplateBoundError(f"the %-format {match.group(0)!r} asks for a width beyond {MAX_WIDTH}")


def _check_format_string(text: str) -> None:
    for _, _, spec, _ in string.Formatter().parse(text):
        if spec and ("{" in spec or any(int(n) > MAX_WIDTH for n in re.findall(r"\d+", spec))):
            raise TemplateBoundError(f"the format spec {spec!r} asks for a width beyond {MAX_WIDTH}")


def _bounded_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be too large, before computing it."""
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
    if operator == "**" and ints and right > 0 and abs(left) > 1 and abs(left).bit_length() * right > MAX_INT_BITS:
        raise TemplateBoundError(f"{left} ** {right} has more than {MAX_INT_BITS} bits")
    if operator == "*":
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBoundError(f"a product of more than {MAX_INT_BITS} bits")
        for sequence, count in ((left, right), (right, left)):
            if _size(sequence) is not None and isinstance(count, int) and len(sequence) * count > MAX_ITEMS:
                raise TemplateBoundError(f"repeating {len(sequence)} items {count} times makes more than {MAX_ITEMS}")
    sizes = (_size(left), _size(right))
    if operator == "+" and None not in sizes and sum(sizes) > MAX_ITEMS:
        raise TemplateBoundError(f"a concatenation of more than {MAX_ITEMS} items")
    if operator == "%" and isinstance(left, str):
        _check_percent_format(left)


class _NoFolding(jinja2.compiler.CodeGenerator):
    """Emits every output expression as code: nothing is evaluated while compiling."""

    def _output_child_to_const(self, node, frame, finalize):
        if isinstance(node, jinja2.nodes.TemplateData):  # plain template text
            return super()._output_child_to_const(node, frame, finalize)
        raise jinja2.nodes.Impossible()


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """`ImmutableSandboxedEnvironment` with the bounds above (see the module's docstring)."""

    code_generator_class = _NoFolding
    intercepted_binops = INTERCEPTED

    def __init__(self, **options):
        super().__init__(optimized=False, **options)
        self.globals["range"] = self._range

    def parse(self, source, name=None, filename=None):
        """jinja's parse, once `source` is known to be within MAX_TEMPLATE_BYTES and MAX_TEMPLATE_TOKENS (lexing
        stops at the first token past the bound, so a huge template is refused in a fraction of a second)."""
        if not isinstance(source, str):
            raise TypeError(f"a template's source is a string, got {type(source).__name__}")
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_TEMPLATE_BYTES:
            raise TemplateBoundError(
                f"the template has {size:,} bytes, more than the {MAX_TEMPLATE_BYTES >> 20} MiB a chat template may "
                "have (real ones have tens of KB at most)"
            )
        for count, _ in enumerate(self.lex(source, name, filename), 1):
            if count > MAX_TEMPLATE_TOKENS:
                raise TemplateBoundError(
                    f"the template has more than {MAX_TEMPLATE_TOKENS:,} tokens (names, literals, operators and "
                    "tags), more than a chat template may have (real ones have a few thousand)"
                )
        return super().parse(source, name, filename)

    def wrap_filters(self) -> None:
        """Bound every filter (call after the last filter is added)."""
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    def _range(self, *args):
        budget = _spend()
        items = safe_range(*args)  # jinja's own cap per call
        if len(items) > budget.range_items:
            raise TemplateBoundError(f"range() calls ask for more than {MAX_RANGE_ITEMS} items in one render")
        budget.range_items -= len(items)
        return items

    def call_binop(self, context, operator, left, right):
        _spend()
        _bounded_binop(operator, left, right)
        return _check_result(super().call_binop(context, operator, left, right), f"the operator {operator}")

    def getattr(self, obj, attribute):
        _spend()
        return self._bounded_format(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        _spend()
        return self._bounded_format(super().getitem(obj, argument))

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's signature: keywords may be named self
        _spend()
        _check_arguments(args, kwargs, f"calling {getattr(__obj, '__name__', 'a function')}")
        return _check_result(super().call(__context, __obj, *args, **kwargs), "a call")

    def _bounded_format(self, value):
        if callable(value) and getattr(value, "__name__", "") in ("format", "format_map"):
            owner = getattr(value, "__wrapped__", value)
            text = getattr(owner, "__self__", None)
            if isinstance(text, str):
                _check_format_string(text)
        return value


def _bounded_filter(name: str, f):
    skip = 1 if _PassArg.from_obj(f) is None else 2  # (value, *args), or (context, value, *args)

    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args, **kwargs):
        _spend()
        _check_arguments(args[skip:], kwargs, f"the filter {name}")
        if name == "format" and len(args) >= skip and isinstance(args[skip - 1], str):
            _check_percent_format(args[skip - 1])  # jinja's format filter is `value % args`
        return _check_result(f(*args, **kwargs), f"the filter {name}")

    return bounded


def refused_statements(ast: jinja2.nodes.Template) -> list[str]:
    """The statements a chat template may not use, each with its line: they need a template loader."""
    return [
        f"{label} (line {node.lineno})" for kind, label in REFUSED_STATEMENTS.items() for node in ast.find_all(kind)
    ]
