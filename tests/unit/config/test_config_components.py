"""Components own their config (issue 64): a model family's shape keys and an optimizer's own
keys are its own dataclass, and the loader validates [model] / [optimizer] against the entry
the config selects (torchllm/config/components.py). Nothing a user writes changed: every
shipped config resolves to the values it resolved to before (tests/data/shipped_configs.json,
taken before the change), and --help and docs/config.md list the same keys
(tests/data/documented_keys.json)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from cli import run_train
from conftest import REPO, tiny_args
from messages import assert_names
from shipped_configs import resolved, shipped
from torchllm import models
from torchllm.config import ConfigError, components, help_text, load_config
from torchllm.config.fields import NON_NEGATIVE, opt
from torchllm.optim import registry as optim_registry
from torchllm.optim.adamw import SPEC as ADAMW

DATA = Path(__file__).resolve().parents[2] / "data"


def test_every_shipped_config_resolves_to_the_values_it_had():
    before = json.loads((DATA / "shipped_configs.json").read_text())
    assert sorted(before) == sorted(shipped())  # the snapshot covers every config the repo ships
    for rel, sections in before.items():
        now = resolved(rel)
        assert sorted(now) == sorted(sections), rel
        for name, values in sections.items():
            # A key of another family (unset: None) is no key of this one's [model] now.
            gone = {k: v for k, v in values.items() if k not in now[name]}
            assert all(v is None for v in gone.values()), (rel, gone)
            assert set(now[name]) <= set(values), (rel, set(now[name]) - set(values))
            assert {k: values[k] for k in now[name]} == now[name], (rel, name)


def _doc_keys(text: str) -> dict[str, set[str]]:
    keys, section = {}, None
    for line in text.splitlines():
        if m := re.match(r"## \[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"\| `(\w+)` \|", line):
            keys.setdefault(section, set()).add(m.group(1))
    return keys


def _by_section(dotted: list[str]) -> dict[str, set[str]]:
    out = {}
    for key in dotted:
        section, name = key.split(".")
        out.setdefault(section, set()).add(name)
    return out


def test_help_and_docs_list_the_keys_they_listed():
    before = json.loads((DATA / "documented_keys.json").read_text())
    docs = _doc_keys((REPO / "docs" / "config.md").read_text())
    assert docs == _by_section(before["docs/config.md"])
    shown = re.findall(r"--(\w+\.\w+)  \(", help_text())
    assert _by_section(shown) == _by_section(before["--help"])


@pytest.fixture
def toy_family(monkeypatch):
    """tests/ importable; the toy family (tests/toy_family) registered on copies of the
    registries when a config imports it, forgotten afterwards."""
    from torchllm.models import registry

    components.builtin()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(components, "_OWN", {s: dict(e) for s, e in components._OWN.items()})
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    yield ["--job.custom_import=toy_family", "--model.name=toy_llama"]
    for name in [m for m in sys.modules if m.split(".")[0] == "toy_family"]:
        del sys.modules[name]


def test_a_family_in_tests_adds_a_shape_key_without_touching_config(tmp_path, toy_family):
    # The key is the family's own: nothing under torchllm/config/ names it.
    config_code = "".join(p.read_text() for p in (REPO / "torchllm" / "config").glob("*.py"))
    assert "mlp_ratio" not in config_code
    cfg = load_config(tiny_args(tmp_path, *toy_family, "--model.mlp_ratio=3"))
    args = models.model_args(cfg.model, cfg.training, cfg.data)
    assert cfg.model.mlp_ratio == 3.0 and args.ffn_hidden_dim == 3 * 64
    ran = run_train(*tiny_args(tmp_path, *toy_family, "--model.mlp_ratio=3",
                               "--training.steps=2", "--job.run_name=toy"))
    assert ran.returncode == 0, ran.out[-3000:]
    # The run's header shows the width the key asked for; its saved config keeps the key.
    assert "toy_llama/debug (2 layers x 64 dim, 4 heads (2 kv) of 16, ffn 192)" in ran.out
    assert "mlp_ratio = 3.0" in (tmp_path / "toy" / "config.toml").read_text()


def test_a_familys_key_is_refused_where_another_family_is_selected(tmp_path, toy_family):
    ran = run_train(*tiny_args(tmp_path, "--job.custom_import=toy_family",
                               "--model.mlp_ratio=3", "--training.steps=1"))
    assert ran.returncode == 2, ran.out[-3000:]
    (line,) = [ln for ln in ran.stderr.splitlines() if "model.mlp_ratio" in ln]
    # the key, the family that declares it, the one selected and what that one allows
    assert_names(line, "--model.mlp_ratio=3", "toy_llama", "'llama3'", "n_kv_heads")
    assert "Traceback" not in ran.out


def test_an_unknown_key_still_names_the_closest_one():
    with pytest.raises(ConfigError) as e:
        load_config(["--model.name=qwen3", "--model.head_dimm=64"])
    assert_names(str(e.value), "model.head_dimm", "model.head_dim")
    with pytest.raises(ConfigError) as e:  # a family's key with an unregistered family
        load_config(["--model.name=nope", "--model.dim=64"])
    assert_names(str(e.value), "model.name = 'nope'", "model.dim", "llama3")


@dataclasses.dataclass
class DampedConfig:
    dampening: float = opt(0.0, "toy: momentum dampening", NON_NEGATIVE)


@pytest.fixture
def damped(monkeypatch):
    """An optimizer (AdamW's builder) that declares one key of its own, `dampening`."""
    components.builtin()
    monkeypatch.setattr(optim_registry, "_REGISTRY", dict(optim_registry._REGISTRY))
    monkeypatch.setattr(components, "_OWN", {s: dict(e) for s, e in components._OWN.items()})
    optim_registry.register(dataclasses.replace(ADAMW, name="damped", config=DampedConfig,
                                                keys=(*ADAMW.keys, "dampening")))


def test_an_optimizers_own_key_is_accepted_where_it_is_selected(damped):
    cfg = load_config(["--optimizer.name=damped", "--optimizer.dampening=0.5"])
    assert cfg.optimizer.dampening == 0.5 and cfg.optimizer.lr == 3e-4
    with pytest.raises(ConfigError) as e:
        load_config(["--optimizer.dampening=0.5"])
    assert_names(str(e.value), "optimizer.dampening", "damped", "'adamw'")


def test_a_declared_key_must_not_shadow_a_shared_one():
    @dataclasses.dataclass
    class Shadow:
        lr: float = opt(1.0, "another lr", NON_NEGATIVE)

    with pytest.raises(ValueError, match="'lr'"):
        components.declare("optimizer", "shadow", type(load_config([]).optimizer), Shadow)
