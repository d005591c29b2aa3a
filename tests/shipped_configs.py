"""Every config file the repository ships, resolved: the snapshot tests/data/shipped_configs.json
(written before issue 64's "components own their config" changed the loader) is what each must
still load to, value for value.

    PYTHONPATH=$PWD python tests/shipped_configs.py > tests/data/shipped_configs.json

rewrites it (only when a key's value is meant to change).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torchllm.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def shipped() -> list[str]:
    """The repository's TOML configs (train_configs/, the tests' saved run configs), relative
    to its root; pyproject.toml is no run config."""
    found = sorted(ROOT.glob("train_configs/*.toml")) + sorted(ROOT.glob("tests/**/config.toml"))
    return [str(p.relative_to(ROOT)) for p in found]


def resolved(rel: str) -> dict:
    """The config `rel` loads to: {section: {key: value}} (lists of tables as dicts)."""
    cfg = load_config(["--job.config_file", str(ROOT / rel)])
    cfg.job.config_file = rel  # where the repository stands is no value of the config
    return {name: {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            for name, obj in cfg.sections()}


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def snapshot() -> dict:
    return {rel: resolved(rel) for rel in shipped()}


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1, sort_keys=True))
