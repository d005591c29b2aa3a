"""Build a JobConfig from defaults, a TOML file and `--section.key=value` CLI overrides.

Precedence: CLI > TOML (`--job.config_file`) > dataclass defaults. Every value is converted to
its field's declared type, and every mistake is a ConfigError that names where it came from
(file or flag), the key, and what is allowed or the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
from pathlib import Path
from typing import Any

from torchllm.config import components
from torchllm.config.job_config import ConfigError, JobConfig
from torchllm.config.values import (  # noqa: F401  (re-exported: one import path)
    check_value, describe_field, describe_type, field_types, parse_string,
)
from torchllm.storage import shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

def _all_keys(cfg: JobConfig) -> list[str]:
    """Every key of `cfg`'s sections, and the own keys of every registered entry."""
    return [*[f"{s}.{f.name}" for s, obj in cfg.sections() for f in dataclasses.fields(obj)],
            *[f"{s}.{row[0].name}" for s in components.SELECTORS
              for row in components.documented(s, _shared(getattr(cfg, s)))]]


def _shared(obj) -> type:
    return components.shared_class(type(obj))


def _not_its_key(section: str, key: str, value: Any, obj) -> ConfigError:
    """A key of [model] / [optimizer] that the selected entry does not declare: the entries
    that do, and the selected one's own keys (the loader prefixes the file or flag)."""
    shared = {f.name for f in dataclasses.fields(_shared(obj))}
    own = [f.name for f in dataclasses.fields(obj) if f.name not in shared]
    chosen = f"{section}.{components.SELECTORS[section]} = {getattr(obj, 'name')!r}"
    return ConfigError(
        f"{section}.{key} = {value} is a key of {section}.name = "
        f"{', '.join(components.owners(section, key))}, not of {chosen} (its own keys: "
        f"{', '.join(own) or 'none'}, besides the [{section}] keys every one takes); unset it "
        "or select one of those", f"{section}.{key}")


def _suggest(section: str, key: str, keys: list[str]) -> str:
    """' did you mean X?' for an unknown key, of all the dotted `keys` (`_all_keys`), or ''
    when nothing is close."""
    same_name = [k for k in keys if k.split(".")[1] == key]
    if same_name:
        return f"; did you mean {same_name[0]}?"
    close = difflib.get_close_matches(f"{section}.{key}", keys, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]}?"
    return ""


def _section(cfg: JobConfig, section: str, where: str):
    names = [name for name, _ in cfg.sections()]
    if section not in names:
        close = difflib.get_close_matches(section, names, n=1)
        hint = f"; did you mean [{close[0]}]?" if close else f"; sections are {', '.join(names)}"
        raise ConfigError(f"{where}: unknown section [{section}]{hint}")
    return getattr(cfg, section)


def _set(cfg: JobConfig, section: str, key: str, value: Any, where: str, from_cli: bool,
         pending: list | None = None) -> str:
    """Set one value (converted to the field's type); returns the dotted key. With `pending`,
    a [model] / [optimizer] key beyond the shared ones waits there until the entry is known."""
    obj = _section(cfg, section, where)
    types_ = field_types(type(obj))
    if (pending is not None and section in components.SELECTORS
            and key not in field_types(_shared(obj))):
        pending.append((section, key, value, where, from_cli))
        return f"{section}.{key}"
    if key not in types_:
        if section in components.SELECTORS and components.owners(section, key):
            raise _not_its_key(section, key, value, obj)
        hint = _suggest(section, key, _all_keys(cfg))
        raise ConfigError(f"{where}: unknown key {section}.{key}{hint}")
    try:
        if from_cli:
            converted = parse_string(value, types_[key])
        else:
            converted = check_value(value, types_[key])
    except ValueError as e:
        raise ConfigError(f"{where}: {section}.{key} = {value!r} {e}") from None
    setattr(obj, key, converted)
    return f"{section}.{key}"


def parse_cli(argv: list[str]) -> list[tuple[str, str, str, str]]:
    """`--section.key=value` / `--section.key value` -> [(section, key, raw value, flag)]."""
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"command line: unexpected argument {arg!r}; overrides look like "
                "--section.key=value (see --help)"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                value = "true"  # a bare flag switches a boolean on
            else:
                value, i = nxt, i + 1
        section, _, key = name.partition(".")
        overrides.append((section, key, value, arg))
        i += 1
    return overrides


def load_toml(path: str | Path, text: str | None = None) -> dict:
    """The TOML file `path` (or, given, its `text`, already read by the caller: a run folder's
    file read through its torchllm.store.Store)."""
    path = Path(path)
    if text is None and not path.is_file():
        raise ConfigError(f"config file {shown(path)} does not exist (set by "
                          "--job.config_file, or CONFIG_FILE for run_train.sh)")
    try:
        if text is not None:
            return tomllib.loads(text)
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: invalid TOML: {e}") from None


def import_custom(module: str | None) -> None:
    """job.custom_import: import the user's module (it registers its model families or
    optimizers), so that every command that loads a config (training, export, generation,
    tools) knows them."""
    if not module:
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"job.custom_import = {module!r} cannot be imported ({e}); give a "
                          "dotted module path importable from the working directory or "
                          "PYTHONPATH", "job.custom_import") from None


# Keys whose value names code that loading the config imports: honoured from the user's own
# config file and command line, never from a checkpoint's config.toml (file_runs_code=False).
CODE_KEYS = {("job", "custom_import")}


def load_config(argv: list[str] | None = None, file_runs_code: bool = True,
                file_text: str | None = None) -> JobConfig:
    """Defaults, then the TOML file named by --job.config_file, then the other CLI overrides.
    `file_runs_code=False`: the file is a checkpoint's (data): its CODE_KEYS are dropped, with
    one warning; the command line's still apply. `file_text`: that file's text, already read
    (confined and bounded) by the caller; the path only names it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = parse_cli(argv)
    cfg = JobConfig()
    sources: dict[str, str] = {}  # dotted key -> the file or flag that set it last
    pending: list = []  # an entry's own keys, set once model.name / optimizer.name are final
    for section, key, value, flag in overrides:
        if (section, key) == ("job", "config_file"):
            cfg.job.config_file = value
    if cfg.job.config_file:
        path = cfg.job.config_file
        for section, table in load_toml(path, file_text).items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"config file {path}: top-level key {section!r} must be a [section] table"
                )
            for key, value in table.items():
                where = f"config file {path}"
                if not file_runs_code and (section, key) in CODE_KEYS:
                    _dropped(section, key, value, path)
                    continue
                sources[_set(cfg, section, key, value, where, False, pending)] = where
        cfg.job.config_file = path
    for section, key, value, flag in overrides:
        sources[_set(cfg, section, key, value, f"flag {flag}", True, pending)] = f"flag {flag}"
    # A file's description names its data ("SFT on SmolTalk"); a command line that swaps the
    # data makes it wrong, so it is dropped (unless the command line sets one too).
    if sources.get("job.description", "").startswith("config file") and any(
            sources.get(k, "").startswith("flag") for k in ("data.dataset", "data.sources")):
        cfg.job.description = ""
    try:
        import_custom(cfg.job.custom_import)
        _select_entries(cfg, pending)
        cfg.validate()
    except ConfigError as e:
        if e.key in sources:
            raise ConfigError(f"{sources[e.key]}: {e}", e.key) from None
        raise
    return cfg


def _select_entries(cfg: JobConfig, pending: list) -> None:
    """[model] / [optimizer] become the selected entry's dataclass (components.py); then the
    keys beyond the shared ones are set, checked against it."""
    for section in components.SELECTORS:
        obj = getattr(cfg, section)
        name = getattr(obj, components.SELECTORS[section])
        waiting = [p for p in pending if p[0] == section]
        if waiting and name not in components.entries(section):
            raise ConfigError(
                f"{section}.name = {name!r} is not registered, so its keys "
                f"({', '.join(f'{section}.{p[1]}' for p in waiting)}) cannot be checked; use "
                f"one of {sorted(components.entries(section))} (a module named by "
                "job.custom_import can register more)", f"{section}.name")
        setattr(cfg, section, components.select(section, obj))
    for section, key, value, where, from_cli in pending:
        _set(cfg, section, key, value, where, from_cli)


def _dropped(section: str, key: str, value: Any, path: str) -> None:
    from torchllm.log import logger

    logger.warning("ignoring %s.%s = %r in the checkpoint's config %s: a checkpoint never "
                   "names code to import (if you trust that module, pass --%s.%s=%s on your "
                   "command line)", section, key, value, path, section, key, value)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):  # an inline table
        return "{" + ", ".join(f"{f.name} = {_toml_value(getattr(value, f.name))}"
                               for f in dataclasses.fields(value)) + "}"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def to_toml(cfg: JobConfig) -> str:
    """The effective config as TOML (unset optional values are omitted; TOML has no null)."""
    lines = []
    for name, obj in cfg.sections():
        lines.append(f"[{name}]")
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def flat_toml(text: str) -> dict[str, object]:
    """A saved config's TOML text as {"section.key": value} (how resumes compare configs)."""
    return {f"{section}.{key}": value for section, table in tomllib.loads(text).items()
            for key, value in table.items()}


def section_rows(name: str, obj) -> list[tuple[dataclasses.Field, Any, Any, str]]:
    """(field, type, default, entries) of every key a section documents: its shared keys
    (entries ""), then for [model] / [optimizer] every registered entry's own keys (entries:
    the names that declare each)."""
    shared = _shared(obj)
    hints = field_types(shared)
    rows = [(f, hints[f.name], getattr(obj, f.name), "") for f in dataclasses.fields(shared)]
    if name in components.SELECTORS:
        rows += components.documented(name, shared)
    return rows


def help_text() -> str:
    """`--help`: every key by section with its type, default and help string."""
    cfg = JobConfig()
    out = [
        "usage: ./run_train.sh [--section.key=value ...]   (or python -m torchllm.train ...)",
        "Precedence: command line > TOML file (--job.config_file) > defaults.",
        "",
    ]
    for name, obj in cfg.sections():
        out.append(f"[{name}]")
        for f, tp, default, entries in section_rows(name, obj):
            only = f"; for {name}.name = {entries}" if entries else ""
            out.append(f"  --{name}.{f.name}  ({describe_field(f, tp)}, default {default!r}"
                       f"{only})\n      {f.metadata['help']}")
        out.append("")
    return "\n".join(out)
