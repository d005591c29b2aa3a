"""Sections whose keys depend on a registry entry: [model] (the family model.name names) and
[optimizer] (optimizer.name).

The section's dataclass (config/sections.py) holds the keys every entry reads. An entry (a
model family, an optimizer) declares its own keys as a dataclass of `opt()` fields beside its
code (e.g. torchllm/models/llama/config.py) and its registry declares them here; the loader
then validates the section against the selected entry's keys: `cfg.model` is an instance of
the section's dataclass extended by the family's (`section_class`), so `cfg.model.dim` reads
as before, and a key no entry of that name declares is refused, naming what is allowed.
Nothing here imports a registry: the built-in entries declare themselves when their package is
imported (`BUILTIN`, imported by name like `job.custom_import`, the first time a section's
class is asked for).
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any

# section -> the key that selects its entry
SELECTORS = {"model": "name", "optimizer": "name"}
# The packages whose import registers (and so declares) the built-in entries.
BUILTIN = ("torchllm.models", "torchllm.optim")

_OWN: dict[str, dict[str, type | None]] = {section: {} for section in SELECTORS}
_CLASSES: dict[tuple[type, str], type] = {}
_builtin = {"state": "no"}  # no -> importing -> done


def declare(section: str, name: str, base: type, own: type | None) -> None:
    """Register entry `name` of `section` (whose shared dataclass is `base`) with its own keys
    (`own`, a dataclass of opt() fields; None: it has no keys of its own). Raises ValueError
    for an own key without a help string or one that is already a key of the section."""
    if own is not None:
        shared = {f.name for f in dataclasses.fields(base)}
        for f in dataclasses.fields(own):
            if f.name in shared:
                raise ValueError(f"{section} {name!r}: its own key {f.name!r} is already a "
                                 f"[{section}] key every entry shares; name it otherwise")
            if not f.metadata.get("help"):
                raise ValueError(f"{section} {name!r}: its own key {f.name!r} has no help "
                                 "string; declare it with torchllm.config.fields.opt()")
    _OWN[section][name] = own
    for key in [k for k in _CLASSES if k[1] == name]:
        del _CLASSES[key]


def builtin() -> None:
    """Import the built-in registries once (they declare their entries on import)."""
    if _builtin["state"] == "no":
        _builtin["state"] = "importing"
        try:
            for module in BUILTIN:
                importlib.import_module(module)
        finally:
            _builtin["state"] = "done"


def entries(section: str) -> dict[str, type | None]:
    """name -> own keys dataclass (or None) of every declared entry of `section`."""
    builtin()
    return dict(_OWN[section])


def section_class(section: str, base: type, name: str) -> type:
    """`base` extended by the own keys of entry `name` (a dataclass subclass, made once per
    entry); `base` itself when the entry declares none or is not declared."""
    own = entries(section).get(name)
    if own is None:
        return base
    if (base, name) not in _CLASSES:
        hints = typing.get_type_hints(own)
        extra = [(f.name, hints[f.name], _copy(f)) for f in dataclasses.fields(own)]
        cls = dataclasses.make_dataclass(f"{base.__name__}_{name}", extra, bases=(base,))
        cls.__doc__ = f"[{section}] keys for {section}.{SELECTORS[section]} = {name!r}"
        cls.__section_base__ = base
        cls.__module__, cls.__qualname__ = __name__, cls.__name__  # pickled by name
        globals()[cls.__name__] = cls
        _CLASSES[(base, name)] = cls
    return _CLASSES[(base, name)]


def default_section(section: str, base: type) -> Any:
    """The section's defaults for its default entry (e.g. llama3's [model] keys)."""
    name = base.__dataclass_fields__[SELECTORS[section]].default
    return section_class(section, base, name)()


def select(section: str, obj: Any) -> Any:
    """`obj`'s shared values in the class of the entry it selects (own keys at defaults)."""
    base = shared_class(type(obj))
    cls = section_class(section, base, getattr(obj, SELECTORS[section]))
    if type(obj) is cls:
        return obj
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(base)})


def owners(section: str, key: str) -> list[str]:
    """The entries of `section` that declare `key`."""
    return sorted(n for n, own in entries(section).items()
                  if own is not None and key in {f.name for f in dataclasses.fields(own)})


def documented(section: str, base: type) -> list[tuple[dataclasses.Field, Any, Any, str]]:
    """(field, type, default, entries) of every own key any entry of `section` declares, once
    each (the first declaration's help), `entries` the names that declare it."""
    rows, seen = [], set()
    for own in entries(section).values():
        if own is None:
            continue
        hints = typing.get_type_hints(own)
        for f in dataclasses.fields(own):
            if f.name not in seen:
                seen.add(f.name)
                default = f.default_factory() if callable(f.default_factory) else f.default
                rows.append((f, hints[f.name], default, ", ".join(owners(section, f.name))))
    return rows


def shared_class(cls: type) -> type:
    """The section's shared dataclass of `cls` (itself, or the base an entry extended)."""
    return cls.__dict__.get("__section_base__", cls)


def _copy(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)
