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
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from torchllm.config.job_config import ConfigError, JobConfig
from torchllm.storage import shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

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


def _all_keys(cfg: JobConfig) -> list[str]:
    return [f"{s}.{f.name}" for s, obj in cfg.sections() for f in dataclasses.fields(obj)]


def _suggest(section: str, key: str, cfg: JobConfig) -> str:
    """' did you mean X?' for an unknown key, or '' when nothing is close."""
    keys = _all_keys(cfg)
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


def _set(cfg: JobConfig, section: str, key: str, value: Any, where: str, from_cli: bool) -> str:
    """Set one value (converted to the field's type); returns the dotted key."""
    obj = _section(cfg, section, where)
    types_ = field_types(type(obj))
    if key not in types_:
        raise ConfigError(f"{where}: unknown key {section}.{key}{_suggest(section, key, cfg)}")
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
                sources[_set(cfg, section, key, value, where, from_cli=False)] = where
        cfg.job.config_file = path
    for section, key, value, flag in overrides:
        sources[_set(cfg, section, key, value, f"flag {flag}", from_cli=True)] = f"flag {flag}"
    # A file's description names its data ("SFT on SmolTalk"); a command line that swaps the
    # data makes it wrong, so it is dropped (unless the command line sets one too).
    if sources.get("job.description", "").startswith("config file") and any(
            sources.get(k, "").startswith("flag") for k in ("data.dataset", "data.sources")):
        cfg.job.description = ""
    try:
        import_custom(cfg.job.custom_import)
        cfg.validate()
    except ConfigError as e:
        if e.key in sources:
            raise ConfigError(f"{sources[e.key]}: {e}", e.key) from None
        raise
    return cfg


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


def help_text(cfg: JobConfig | None = None) -> str:
    """`--help`: every key by section with its type, default and help string."""
    cfg = cfg or JobConfig()
    out = [
        "usage: ./run_train.sh [--section.key=value ...]   (or python -m torchllm.train ...)",
        "Precedence: command line > TOML file (--job.config_file) > defaults.",
        "",
    ]
    for name, obj in cfg.sections():
        out.append(f"[{name}]")
        hints = field_types(type(obj))
        for f in dataclasses.fields(obj):
            out.append(
                f"  --{name}.{f.name}  ({describe_field(f, hints[f.name])}, default "
                f"{getattr(obj, f.name)!r})\n      {f.metadata['help']}"
            )
        out.append("")
    return "\n".join(out)
