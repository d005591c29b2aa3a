"""How large a value a chat template's operation would build, known before it is built
(chat/bounded.py refuses the operation past `limits.RENDER_CHARS`): the length of a value's
text, of a `%` format's result, of a `str.format` field.

Sizes are counted, never built: `[s] * 1000` (1000 references to one string, cheap) is 1000
times `s` long as text, and `str()` of it, `|tojson`, `~`, `|join` would build all of it in one
C call. A count stops as soon as it passes the limit, so it costs at most that many steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Set, ValuesView

from torchllm.data.chat import limits
from torchllm.data.chat.limits import RenderLimit

MAX_DEPTH = 1000  # nesting of a value counted (str() of a deeper one is a RecursionError)
NUMBER_CHARS = 330  # a float's text (1e308 as %f: 309 digits) or a number's precision slack


def refuse_over(what: str, size: int) -> None:
    """RenderLimit when `what` would build more than RENDER_CHARS characters (or items)."""
    if size > limits.RENDER_CHARS:
        raise RenderLimit(f"{what} would build {size:,} characters or items (at most "
                          f"{limits.RENDER_CHARS:,})")


def checked_int(what: str, n) -> int:
    """`n` (a width, a count: what sets a result's size), refused past RENDER_CHARS."""
    if isinstance(n, int) and not isinstance(n, bool):
        refuse_over(what, abs(n))
        return abs(n)
    return 0


def _items(value):
    """What a container's text is made of (None: not a container)."""
    if isinstance(value, Mapping):
        return itertools.chain.from_iterable(value.items())
    if isinstance(value, (list, tuple, Set, ValuesView)):
        return iter(value)
    if type(value).__name__ == "Namespace":  # jinja2's namespace(): its text shows its attrs
        try:
            return itertools.chain.from_iterable(
                object.__getattribute__(value, "_Namespace__attrs").items())
        except AttributeError:
            return None
    return None


def text_size(value, budget: int | None = None, indent=None) -> int:
    """About the length of str(value) (and of its repr or JSON): a string's length (+2 quotes
    inside a container), a number's digits, a container's items, each as often as it occurs,
    plus separators (and `indent` per nesting level and item, JSON's or pprint's). The count
    stops once it passes `budget` (RENDER_CHARS); a deeper nesting than MAX_DEPTH is refused."""
    budget = limits.RENDER_CHARS if budget is None else budget
    pad = len(indent) if isinstance(indent, str) else (
        max(indent, 0) if isinstance(indent, int) else 0)
    # A container met again (`[inner] * 1000`) adds what it added the first time (at the same
    # depth, when indented): counted once, not walked again.
    total, stack, end, known = 0, [(iter((value,)), None, 0)], object(), {}
    while stack:
        items, key, start = stack[-1]
        v = next(items, end)
        if v is end:
            stack.pop()
            if key is not None:
                known[key] = total - start
            continue
        depth = len(stack) - 1
        if depth:
            total += 2 + ((pad * depth + 1) if indent is not None else 0)  # ", " / ": " + line
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v) + (2 if depth else 0)
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, float):
            total += 24
        elif any(c.__name__ == "Undefined" for c in type(v).__mro__):
            pass  # jinja2's undefined: '' as text
        else:
            key = (id(v), depth if indent is not None else 0)
            if key in known:
                total += known[key]
            else:
                inner = _items(v)
                if inner is None:
                    total += 64  # another object (a macro, a loop, a range): a short repr
                else:
                    if len(stack) > MAX_DEPTH:
                        raise RenderLimit(f"a value nested more than {MAX_DEPTH} deep")
                    total += 2
                    stack.append((inner, key, total - 2))
        if total > budget:
            return total
    return total


def _number(text: str, i: int) -> tuple[int, int]:
    """(the digits at text[i:] as an int (past RENDER_CHARS when longer than 12 digits), end)."""
    j = i
    while j < len(text) and text[j].isdigit():
        j += 1
    digits = text[i:j]
    return (int(digits) if len(digits) <= 12 else limits.RENDER_CHARS + 1) if digits else 0, j


def percent_size(fmt, args) -> int:
    """About the length of `fmt % args` (printf-style: the `%` operator, the `format` filter):
    the format's text plus each conversion's widest of its width, its precision and its
    value's text. Parsed as Python parses it; what Python would refuse is left to Python."""
    text = fmt.decode("latin-1") if isinstance(fmt, (bytes, bytearray)) else str(fmt)
    positional = args if isinstance(args, tuple) else (args,)
    budget = limits.RENDER_CHARS
    total, i, k, n = 0, 0, 0, len(text)

    def take():
        nonlocal k
        k += 1
        return positional[k - 1] if k <= len(positional) else None

    while True:
        j = text.find("%", i)
        if j < 0:
            return total + n - i
        total, i, key = total + j - i, j + 1, None
        if i < n and text[i] == "(":
            depth, start = 1, i + 1
            i += 1
            while i < n and depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            key = text[start:i - 1]
        while i < n and text[i] in "-+ #0":
            i += 1
        if i < n and text[i] == "*":
            width, i = take(), i + 1
            width = abs(width) if isinstance(width, int) else 0
        else:
            width, i = _number(text, i)
        precision = None
        if i < n and text[i] == ".":
            if i + 1 < n and text[i + 1] == "*":
                precision, i = take(), i + 2
                precision = abs(precision) if isinstance(precision, int) else 0
            else:
                precision, i = _number(text, i + 1)
        while i < n and text[i] in "hlL":
            i += 1
        conversion = text[i] if i < n else ""
        i += 1
        if conversion == "%":
            size = 1
        else:
            if key is None:
                value = take()
            else:
                try:
                    value = args[key]
                except Exception:  # noqa: BLE001 - Python's own % reports it
                    value = None
            size = _conversion_size(conversion, value, precision, budget)
        total += max(width, size)
        if total > budget:
            return total


def _conversion_size(conversion: str, value, precision, budget: int) -> int:
    if conversion in "sra":
        size = text_size(value, budget)
        return size if precision is None else min(size, precision)
    if conversion == "c":
        return 1
    if conversion in "diouxX":
        digits = text_size(value, budget) if isinstance(value, int) else NUMBER_CHARS
        return max(digits, (precision or 0) + 2)
    return NUMBER_CHARS + (precision or 0)  # eEfFgG (and what Python will refuse)


def spec_size(spec: str) -> int:
    """The most a `str.format` field's spec (`{:>999}`, `{:.5f}`) can add: its numbers (width,
    precision) summed."""
    total, i = 0, 0
    while i < len(spec):
        if spec[i].isdigit():
            number, i = _number(spec, i)
            total += number
        else:
            i += 1
    return total


def checked_binop(operator: str, left, right, compute):
    """`left <operator> right` unless it would build a value past the caps (a sequence of more
    than limits.RENDER_CHARS items, an integer of more than limits.POW_BITS bits, a `%` format's text of more
    than limits.RENDER_CHARS characters)."""
    sized = (str, bytes, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(n, int) and len(seq) * n > limits.RENDER_CHARS:
                raise RenderLimit(f"'*' would build {len(seq) * n:,} items (at most "
                                  f"{limits.RENDER_CHARS:,})")
        if isinstance(left, int) and isinstance(right, int) \
                and left.bit_length() + right.bit_length() > limits.POW_BITS:
            raise RenderLimit(f"'*' would build an integer of about "
                              f"{left.bit_length() + right.bit_length():,} bits (at most "
                              f"{limits.POW_BITS})")
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        refuse_over("'+'", len(left) + len(right))
    if operator == "%" and isinstance(left, (str, bytes)):
        refuse_over("'%' formatting", percent_size(left, right))
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > limits.POW_BITS:
            raise RenderLimit(f"'**' would build an integer of about "
                              f"{right * abs(left).bit_length():,} bits (at most {limits.POW_BITS})")
    result = compute(left, right)
    limits.count_built(result)
    return result
