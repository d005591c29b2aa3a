"""[model] shape keys (dim, n_layers, n_heads, n_kv_heads, head_dim, hidden_dim,
ffn_dim_multiplier) override the flavor's shape: checked against the flavor table and against
parameter counts computed by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from torchllm import models
from torchllm.config import ConfigError, load_config
from torchllm.train import Trainer

from cli import run_module
from conftest import build_model, tiny_args, tiny_config

# The built-in families' own shape keys (each declared in models/<family>/config.py).
SHAPE_KEYS = tuple(dict.fromkeys(k for name in ("llama3", "gpt2", "qwen3")
                                 for k in models.get(name).shape_keys))
BASE = ["--data.tokenizer_vocab_size=512", "--model.vocab_size=512", "--training.seq_len=32"]


def args_of(cfg):
    """The model args of a loaded config (its [model], [training] and [data] sections)."""
    return models.model_args(cfg.model, cfg.training, cfg.data)


def n_params(args, name: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in models.get(name).build(args).parameters())


def own_shape_flags(args) -> list[str]:
    """Every shape key the family's args have, set to the flavor's own value."""
    known = {f.name for f in dataclasses.fields(args)}
    flags = []
    for key in SHAPE_KEYS:
        if key not in known or key == "ffn_dim_multiplier":
            continue
        value = args.ffn_hidden_dim if key == "hidden_dim" else getattr(args, key)
        flags.append(f"--model.{key}={value}")
    return flags


def initial_loss(name: str, args) -> float:
    model = build_model(models.get(name).model_cls, args, seed=3)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=g)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).item()


FLAVORS = [("llama3", f) for f in ("debug", "small", "125M", "1B", "8B")] + \
    [("gpt2", f) for f in ("debug", "124M", "1.5B")] + \
    [("qwen3", f) for f in ("debug", "0.6B", "8B")] + \
    [("qwen3_moe", f) for f in ("debug", "30B-A3B")]


@pytest.mark.parametrize("name,flavor", FLAVORS)
def test_own_shape_keys_rebuild_the_flavor(name, flavor):
    base = [f"--model.name={name}", f"--model.flavor={flavor}", *BASE]
    plain = args_of(load_config(base))
    flags = own_shape_flags(models.get(name).flavors[flavor])
    assert len(flags) >= 4  # dim, n_layers, n_heads and the FFN width at least
    same = args_of(load_config([*base, *flags]))
    # Same shape (Llama's derived FFN width becomes explicit: the same width).
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim",
                  "vocab_size", "max_seq_len"):
        assert getattr(same, field) == getattr(plain, field), field
    assert n_params(same, name) == n_params(plain, name)
    if flavor == "debug":  # small enough to run: the same initial loss from the same seed
        assert initial_loss(name, same) == initial_loss(name, plain)


def test_llama_multiplier_key_reproduces_the_8b_width():
    base = ["--model.name=llama3", "--model.flavor=8B"]
    assert args_of(load_config([*base, "--model.ffn_dim_multiplier=1.3"])) == \
        args_of(load_config(base))
    # On a flavor with an explicit width, the multiplier replaces it: 2/3*4*768 = 2048, x 1.5
    args = args_of(load_config(["--model.flavor=125M", "--model.ffn_dim_multiplier=1.5"]))
    assert args.ffn_hidden_dim == 3072 and args.hidden_dim is None


def gpt2_params(L, d, V, T, h=None):  # tied embeddings, learned positions, biases everywhere
    h = h or 4 * d
    block = 2 * d + (4 * d * d + 4 * d) + 2 * d + (d * h + h) + (h * d + d)
    return V * d + T * d + L * block + 2 * d


def llama_params(L, d, V, n_heads, n_kv, h):  # untied, RMSNorm weights only, no biases
    hd = d // n_heads
    block = d + d * d + 2 * d * n_kv * hd + d * d + d + 3 * d * h
    return 2 * V * d + L * block + d


def test_gpt2_4x128_and_llama_20_layers_match_a_by_hand_count():
    gpt = args_of(load_config(
        ["--model.name=gpt2", "--model.n_layers=4", "--model.dim=128", *BASE]))
    assert (gpt.n_layers, gpt.dim, gpt.ffn_hidden_dim, gpt.vocab_size) == (4, 128, 512, 512)
    assert n_params(gpt, "gpt2") == gpt2_params(4, 128, 512, 32)
    llama = args_of(load_config(["--model.n_layers=20", *BASE]))
    # debug flavor: dim 256, 8 heads, 4 kv heads; SwiGLU 2/3*4*256 = 682 -> multiple of 256: 768
    assert n_params(llama, "llama3") == llama_params(20, 256, 512, 8, 4, 768)
    odd = args_of(load_config(
        ["--model.n_layers=3", "--model.dim=192", "--model.n_heads=6", "--model.n_kv_heads=2",
         "--model.hidden_dim=500", *BASE]))
    assert n_params(odd, "llama3") == llama_params(3, 192, 512, 6, 2, 500)


def run_tool(module: str, *flags: str) -> dict:
    out = run_module(module, *flags)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_tools_show_the_overridden_shape():
    flags = ["--model.name=gpt2", "--model.n_layers=4", "--model.dim=128", *BASE]
    expected = gpt2_params(4, 128, 512, 32)
    info = run_tool("torchllm.tools.model_info", "--json", *flags)
    assert info["params"] == expected and (info["layers"], info["dim"]) == (4, 128)
    assert info["shape"].startswith("4 layers x 128 dim")
    estimate = run_tool("torchllm.tools.estimate_memory", "--json", "--training.device=cpu",
                        *flags)
    assert estimate["params"] == expected
    assert estimate["terms_bytes"]["params"] == 4 * expected


def test_run_header_shows_the_overridden_shape(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="torchllm"):
        trainer = Trainer(tiny_config(tmp_path, "--model.n_layers=2", "--model.dim=128"))
    trainer.close()
    assert "llama3/debug (2 layers x 128 dim, 8 heads (4 kv) of 16" in caplog.text
    assert sum(p.numel() for p in trainer.model.parameters()) == \
        llama_params(2, 128, 512, 8, 4, 512)


# What each message carries besides the key: the family (or family/flavor), the values that
# clash, and what is allowed where the rule is not the key's own.
@pytest.mark.parametrize("flags,key,carried", [
    (["--model.name=gpt2", "--model.n_kv_heads=2"], "model.n_kv_heads", ("gpt2", "dim, n_layers")),
    (["--model.name=gpt2", "--model.ffn_dim_multiplier=1.3"], "model.ffn_dim_multiplier",
     ("gpt2", "hidden_dim")),
    (["--model.head_dim=32"], "model.head_dim", ("llama3", "= 32")),
    (["--model.dim=100"], "model.dim", ("dim=100", "n_heads=8", "llama3/debug")),
    (["--model.n_heads=6"], "model.n_heads", ("dim=256", "n_heads=6")),
    (["--model.n_kv_heads=3"], "model.n_kv_heads", ("n_heads=8", "n_kv_heads=3")),
    (["--model.name=qwen3", "--model.n_kv_heads=3"], "model.n_kv_heads",
     ("n_heads=8", "n_kv_heads=3", "qwen3/debug")),
    (["--model.name=qwen3", "--model.head_dim=33"], "model.head_dim", ("head_dim=33", "even")),
    (["--model.dim=80", "--model.n_heads=16"], "model.dim",
     ("head_dim=5", "even", "model.dim=80", "model.n_heads=16")),
    (["--model.n_layers=0"], "model.n_layers", ("= 0", "positive")),
    (["--model.hidden_dim=512", "--model.ffn_dim_multiplier=1.3"], "model.ffn_dim_multiplier",
     ("model.hidden_dim",)),
    (["--model.n_layers=3", "--model.sliding_window=4,4,4,4"], "model.sliding_window",
     ("[4, 4, 4, 4]", "3 entries")),
])
def test_inconsistent_shape_is_a_one_line_config_error(flags, key, carried):
    with pytest.raises(ConfigError) as e:
        args_of(load_config([*flags, *BASE]))
    assert all(c in str(e.value) for c in carried), (carried, str(e.value))
    assert e.value.key == key and "\n" not in str(e.value) and key in str(e.value)


def test_model_info_table_and_json_show_the_shape(capsys):
    """The table has a shape row (layers x dim, heads, ffn) and --json the same `shape`; the
    numbers are the overridden ones."""
    from torchllm.tools import model_info as mi

    flags = ["--model.name=llama3", "--model.flavor=debug", "--model.n_layers=3",
             "--model.dim=96", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--model.hidden_dim=200"]
    assert mi.main(list(flags)) == 0
    table = capsys.readouterr().out
    assert mi.main([*flags, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    (row,) = [ln for ln in table.splitlines() if ln.split()[:1] == ["shape"]]
    assert row.split(None, 1)[1] == info["shape"] == \
        "3 layers x 96 dim, 4 heads (2 kv) of 24, ffn 200"


def test_cli_reports_a_bad_shape_key_with_exit_code_2():
    out = run_module("torchllm.tools.model_info", "--model.name=gpt2", "--model.n_kv_heads=2")
    assert out.returncode == 2 and "model.n_kv_heads" in out.stderr, out.out[-3000:]


@pytest.mark.slow
def test_resume_with_another_shape_is_refused(tmp_path):
    ckpt = ["--checkpoint.enable", "--job.run_name=run", "--training.steps=1"]
    Trainer(tiny_config(tmp_path, *ckpt)).train()
    with pytest.raises(ConfigError) as e:
        Trainer(tiny_config(tmp_path, *ckpt, "--training.steps=2", "--model.n_layers=2"))
    # the checkpoint named, and what to check (the model keys), not a sentence
    assert str(tmp_path / "run" / "checkpoint") in str(e.value) and "model." in str(e.value), \
        str(e.value)
    assert tiny_args(tmp_path)  # the first run's folder is still usable with its own shape
    assert Trainer(tiny_config(tmp_path, *ckpt, "--training.steps=2")).step == 1
