"""The Jinja environment a chat template renders in: jinja2's immutable sandbox where every
operation that can build a large string, list or integer is capped before it builds it
(chat/limits.py's RENDER_CHARS and POW_BITS; sizes from chat/sizes.py), at render time only.

    operators    `*`, `+`, `%` (printf formatting), `**`: sizes.checked_binop; `~`: its
                 operands' text (the code generator calls `checked_concat`)
    filters      only jinja2's known filters (and tojson), each checked: a width or count that
                 sets a result's size (center, indent, batch, slice), the text a filter makes
                 of its value (string, tojson, pprint, upper, ...: `[s] * 1000` is 1000 `s`),
                 what it adds (join, replace, wordwrap, urlize, format's `%`), sum as a loop
                 of checked `+`; and a result longer than RENDER_CHARS is refused
    tests        the same (`lower` / `upper` make text of their value)
    methods      a str's or bytes' center / ljust / rjust / zfill / expandtabs / replace /
                 join / translate / format / format_map, an int's to_bytes (bound when read)
    output       every `{{ }}` (also inside macros, call and set blocks) counts toward the
                 render's RENDER_CHARS (limits.count_output): doubling a value in a loop stops
    globals      range (the sandbox's, 100,000 items), dict, namespace, cycler, joiner (no lipsum)

Nothing runs at compile time: each filter and test takes the context, and jinja2's constant
folding calls none that does, so `{{ 'x'|center(3000000000) }}` reaches the capped
filter when rendered, inside the time limit, not in `from_string`.
"""

from __future__ import annotations

import json
import operator
import types
from collections.abc import Mapping

from jinja2 import Environment
from jinja2.compiler import CodeGenerator
from jinja2.defaults import DEFAULT_FILTERS, DEFAULT_TESTS
from jinja2.filters import make_attrgetter
from jinja2.nodes import EvalContext
from jinja2.runtime import Context, markup_join, str_join
from jinja2.sandbox import (ImmutableSandboxedEnvironment, SandboxedEscapeFormatter,
                            SandboxedFormatter)
from jinja2.utils import _PassArg
from markupsafe import Markup

from torchllm.data.chat.limits import count_built, count_output
from torchllm.data.chat.sizes import checked_binop
from torchllm.data.chat.sizes import (checked_int, percent_size, refuse_over, spec_size,
                                      text_size)

GLOBALS = ("range", "dict", "namespace", "cycler", "joiner")


def _text(what):
    """A filter or test that makes text of its value: the value's text size checked."""
    def guard(env, value, *args, **kwargs):
        refuse_over(what, text_size(value))
    return guard


def _lines(text) -> int:
    return text.count("\n") + 1 if isinstance(text, str) else text_size(text) + 1


def _center(env, value, width=80):
    refuse_over("center", max(text_size(value), checked_int("center's width", width)))


def _indent(env, s, width=4, first=False, blank=False):
    step = len(width) if isinstance(width, str) else checked_int("indent's width", width)
    refuse_over("indent", text_size(s) + _lines(s) * step)


def _wordwrap(env, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    size = text_size(s)
    step = text_size(wrapstring) if wrapstring is not None else len(env.newline_sequence)
    refuse_over("wordwrap", size + (size + 1) * step)  # at most a line per character


def _replace(env, s, old, new, count=None):
    refuse_over("replace", text_size(s) + text_size(new))
    _replaced("replace", str(s), str(old), str(new), -1 if count is None else count)


def _replaced(what, s, old, new, count):
    found = len(s) + 1 if not old else s.count(old)
    found = found if not isinstance(count, int) or count < 0 else min(found, count)
    refuse_over(what, len(s) + found * max(len(new) - len(old), 0))


def _join(env, value, d="", attribute=None):
    items = list(value) if attribute is None else list(map(make_attrgetter(env, attribute),
                                                         value))
    size = text_size(d) * max(len(items) - 1, 0)
    for item in items:
        size += text_size(item)
        refuse_over("join", size)
    return (items, d), {}


def _format(env, value, *args, **kwargs):
    refuse_over("format", text_size(value))
    refuse_over("format", percent_size(str(value), kwargs or args))


def _count(name, index):
    def guard(env, value, *args, **kwargs):
        n = args[index] if len(args) > index else kwargs.get(
            {"batch": "linecount", "slice": "slices"}[name])
        checked_int(f"{name}'s count", n)
    return guard


def _urlize(env, value, trim_url_limit=None, nofollow=False, target=None, rel=None,
            extra_schemes=None):
    size = text_size(value)
    link = text_size(target or "") + text_size(rel or "") + 64
    refuse_over("urlize", 6 * size + (size // 2 + 1) * link)


def _tojson(env, x, indent=None, **kwargs):
    refuse_over("tojson", text_size(x, indent=indent))


def tojson(x, indent=None, **kwargs):
    """transformers' tojson: JSON, not HTML-escaped, unicode kept."""
    return json.dumps(x, indent=indent, ensure_ascii=False)


def bounded_sum(environment, iterable, attribute=None, start=0):
    """jinja2's `sum` as a loop of checked `+` (a C `sum` of lists is quadratic, and no time
    limit could interrupt it)."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    total = start
    for item in iterable:
        total = checked_binop("+", total, item, operator.add)
    return total


bounded_sum.jinja_pass_arg = _PassArg.environment

# Every filter a template may use: its guard (None: it builds nothing larger than its value).
FILTER_GUARDS = {
    "center": _center, "indent": _indent, "wordwrap": _wordwrap, "replace": _replace,
    "join": _join, "format": _format, "batch": _count("batch", 0), "slice": _count("slice", 0),
    "urlize": _urlize, "tojson": _tojson, "pprint": lambda env, v, *a, **k: refuse_over(
        "pprint", text_size(v, indent=1)),
    **{name: _text(name) for name in (
        "capitalize", "e", "escape", "forceescape", "lower", "upper", "title", "trim",
        "truncate", "safe", "string", "striptags", "urlencode", "wordcount", "xmlattr")},
    **{name: None for name in (
        "abs", "attr", "count", "d", "default", "dictsort", "filesizeformat", "first", "float",
        "groupby", "int", "items", "last", "length", "list", "map", "max", "min", "random",
        "reject", "rejectattr", "reverse", "round", "select", "selectattr", "sort", "sum",
        "unique")},
}
TEST_GUARDS = {"lower": _text("the lower test"), "upper": _text("the upper test")}


def _bounded(name: str, func, guard):
    """`func` (a filter or test) behind `guard`, its result's size checked."""
    kind = _PassArg.from_obj(func)

    def call(first, *args, **kwargs):
        # `first`: what jinja2 passes as the filter declares it takes (the context; when
        # folded, what `func` takes: an eval context, the environment, the value itself).
        if kind is None and not isinstance(first, (Context, EvalContext)):
            args, first = (first, *args), None
        environment = first if isinstance(first, Environment) else getattr(
            first, "environment", None)
        if guard is not None:
            changed = guard(environment, *args, **kwargs)
            if changed is not None:
                args, kwargs = changed
        lead = {_PassArg.context: (first,), _PassArg.environment: (environment,),
                _PassArg.eval_context: (getattr(first, "eval_ctx", first),)}.get(kind, ())
        return checked_result(name, func(*lead, *args, **kwargs))

    call.__name__ = call.__qualname__ = f"bounded_{name}"
    # jinja2 folds a filter or test of constants (`'x'|center(3000000000)`) when it compiles the
    # template (from_string: no time limit there) unless it takes the context: each takes it.
    call.jinja_pass_arg = _PassArg.context
    return call


def checked_result(what: str, result):
    if isinstance(result, (str, bytes, list, tuple)):
        refuse_over(what, len(result))
        count_built(result)
    return result


def _width(what):
    def guard(s, width, *rest, **kwargs):
        checked_int(f"{what}'s width", width)
    return guard


def _to_bytes(n, length=1, *args, **kwargs):
    checked_int("to_bytes' length", length)


def _method_join(s, iterable):
    items = list(iterable)
    size = len(s) * max(len(items) - 1, 0)
    for item in items:
        size += text_size(item)
        refuse_over("join", size)
    return (items,), {}


def _translate(s, table):
    values = table.values() if isinstance(table, Mapping) else \
        table if isinstance(table, (list, tuple)) else ()
    longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
    refuse_over("translate", len(s) * max(longest, 1))


def _expandtabs(s, tabsize=8):
    tabs = s.count("\t" if isinstance(s, str) else b"\t")
    refuse_over("expandtabs", len(s) + tabs * checked_int("expandtabs' size", tabsize))


def _method_replace(s, old, new, count=-1):
    refuse_over("replace", text_size(new))
    if isinstance(old, (str, bytes)) and isinstance(new, (str, bytes)):
        _replaced("replace", s, old, new, count)


# A str's or bytes' methods that build more than their text (the others build at most a few
# times it: upper, encode, split ...).
METHOD_GUARDS = {
    "center": _width("center"), "ljust": _width("ljust"), "rjust": _width("rjust"),
    "zfill": _width("zfill"), "expandtabs": _expandtabs, "replace": _method_replace,
    "join": _method_join, "translate": _translate,
}


def _guarded_method(method, guard):
    owner = method.__self__

    def call(*args, **kwargs):
        changed = guard(owner, *args, **kwargs)
        if changed is not None:
            args, kwargs = changed
        return checked_result(method.__name__, method(*args, **kwargs))

    return call


class _Checked:
    """A `str.format` formatter that counts what each field adds before it is made."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.size = 0

    def convert_field(self, value, conversion):
        refuse_over("format", self.size + text_size(value))
        return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
        self.size += max(spec_size(format_spec), text_size(value)) + 2
        refuse_over("format", self.size)
        return super().format_field(value, format_spec)


class CheckedFormatter(_Checked, SandboxedFormatter):
    pass


class CheckedEscapeFormatter(_Checked, SandboxedEscapeFormatter):
    pass


class BoundedGenerator(CodeGenerator):
    """`a ~ b` as `environment.checked_concat(...)` (jinja2's str_join / markup_join, after
    its operands' text is counted)."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.checked_concat(context.eval_ctx, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = BoundedGenerator

    def __init__(self, **options):
        super().__init__(finalize=self.counted_output, **options)
        originals = {**DEFAULT_FILTERS, "tojson": tojson}
        self.filters = {name: _bounded(name, originals[name], guard)
                        for name, guard in FILTER_GUARDS.items()}
        self.filters["sum"] = _bounded("sum", bounded_sum, None)
        self.tests = {name: _bounded(name, test, TEST_GUARDS.get(name))
                      for name, test in DEFAULT_TESTS.items()}
        self.globals = {name: self.globals[name] for name in GLOBALS}

    def call_binop(self, context, operator, left, right):
        return checked_binop(operator, left, right, self.binop_table[operator])

    @staticmethod
    def counted_output(value):
        count_output(text_size(value))
        return value

    @staticmethod
    def checked_concat(eval_ctx, items):
        size = 0
        for item in items:
            size += text_size(item)
            refuse_over("'~'", size)
        return checked_result("'~'", markup_join(items) if eval_ctx.autoescape else
                              str_join(items))

    def wrap_str_format(self, value):
        """A str's or bytes' method, read by the template: format / format_map with the
        checked formatter, the growing ones (METHOD_GUARDS) behind their guard."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)):
            return None
        owner, name = getattr(value, "__self__", None), value.__name__
        if isinstance(owner, int) and not isinstance(owner, bool) and name == "to_bytes":
            return _guarded_method(value, _to_bytes)
        if not isinstance(owner, (str, bytes)):
            return None
        if name in ("format", "format_map") and isinstance(owner, str):
            return self._format_method(owner, name == "format_map")
        guard = METHOD_GUARDS.get(name)
        return _guarded_method(value, guard) if guard is not None else None

    def _format_method(self, owner: str, is_format_map: bool):
        def call(*args, **kwargs):
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            formatter = (CheckedEscapeFormatter(self, escape=owner.escape)
                         if isinstance(owner, Markup) else CheckedFormatter(self))
            return checked_result("format", type(owner)(formatter.vformat(owner, args, kwargs)))

        return call
