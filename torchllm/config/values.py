"""A config value against its field's declared type: TOML values checked, command-line strings
parsed, and both described in --help, docs/config.md and errors (loader.py uses these)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", ""}


def field_types(section_cls) -> dict[str, Any]:
    """Resolved type hints of a section dataclass (the module uses postponed annotations)."""
    return typing.get_type_hints(section_cls)


def describe_type(tp) -> str:
    """Human-readable form of a field type, for help text and errors."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{describe_type(inner[0])} (optional)"
    if origin is list and dataclasses.is_dataclass(args[0]):
        names = ", ".join(f.name for f in dataclasses.fields(args[0]))
        return f"list of {{{names}}} tables"
    if origin is list:
        return f"list of {describe_type(args[0])} (a,b,c)"
    return getattr(tp, "__name__", str(tp))


def describe_field(f: dataclasses.Field, tp) -> str:
    """A field's type, with the Range of a float field: "float; in [0, 1)"."""
    allowed = f.metadata.get("allowed")
    return describe_type(tp) + (f"; {allowed}" if allowed is not None else "")


def _table(value: Any, tp) -> Any:
    """A TOML table (dict) -> the dataclass `tp`, every key known and type-checked."""
    if not isinstance(value, dict):
        raise ValueError(f"must be a list of tables with keys {describe_type(list[tp])}")
    hints = field_types(tp)
    unknown = sorted(set(value) - set(hints))
    if unknown:
        raise ValueError(f"has unknown key {unknown[0]!r}; table keys are {', '.join(hints)}")
    checked = {}
    for k, v in value.items():
        try:
            checked[k] = check_value(v, hints[k])
        except ValueError as e:
            raise ValueError(f"key {k!r} {e}") from None
    return tp(**checked)


def _table_from_string(text: str, tp) -> Any:
    """'DATASET=WEIGHT' (the CLI form of a list of tables whose first two fields are these)."""
    first, second = [f.name for f in dataclasses.fields(tp)][:2]
    head, sep, tail = text.rpartition("=")
    if not sep:
        raise ValueError(f"must be {first.upper()}={second.upper()} items, e.g. local:a.txt=0.7")
    return _table({first: head, second: parse_string(tail, field_types(tp)[second])}, tp)


def parse_string(text: str, tp) -> Any:
    """Convert a CLI string to `tp`; raises ValueError with the allowed form."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        # An empty string is a value of an optional string (checked like any other: an empty
        # --job.run_name is an error, not "unset"); `none` clears it.
        if text.strip().lower() in _NONE and not (inner[0] is str and text == ""):
            return None
        return parse_string(text, inner[0])
    if origin is Literal:
        if text not in args:
            raise ValueError(f"must be one of {describe_type(tp)}")
        return text
    if origin is list and dataclasses.is_dataclass(args[0]):
        return [_table_from_string(p.strip(), args[0]) for p in text.split(",") if p.strip()]
    if origin is list:
        return [parse_string(part.strip(), args[0]) for part in text.split(",") if part.strip()]
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError("must be a boolean (true/false)")
    if tp is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ValueError("must be an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("must be a number (e.g. 0.1 or 6e-4)") from None
    return text


def check_value(value: Any, tp) -> Any:
    """Check (and lightly coerce, int -> float) a TOML value against `tp`; raises ValueError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value == "" and inner[0] is str:
            return None  # TOML has no null: config.toml files of older runs say run_name = ""
        return check_value(value, inner[0])
    if origin is Literal:
        if value not in args:
            raise ValueError(f"must be one of {describe_type(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"must be a list ({describe_type(tp)})")
        if dataclasses.is_dataclass(args[0]):
            return [_table(v, args[0]) for v in value]
        return [check_value(v, args[0]) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (tp is int and isinstance(value, bool)) or not isinstance(value, tp):
        raise ValueError(f"must be {describe_type(tp)}, got {type(value).__name__} {value!r}")
    return value
