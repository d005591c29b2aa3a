"""The model contract (torchllm/models/contract.py): every registered family's model has each
member the trainer, parallel plans, exporter, LoRA and estimators touch, with the shapes the
contract states; a model that drops one is refused by name when its spec builds it. PEFT names
come from each family's adapter (no family table in torchllm/hf/)."""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
from torch import nn

from conftest import REPO
from torchllm import models
from torchllm.config import ConfigError
from torchllm.models import registry
from torchllm.models.contract import (
    ARGS_MEMBERS, MEMBERS, LanguageModel, ModelArgs, check_model, missing_members,
)

FAMILIES = sorted(registry._REGISTRY)


def _debug_args(name: str):
    flavors = models.get(name).flavors
    return flavors["debug"] if "debug" in flavors else next(iter(flavors.values()))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_registered_family_satisfies_the_contract_with_its_shapes(name, tied):
    spec = models.get(name)
    args = dataclasses.replace(_debug_args(name), tie_embeddings=tied)
    with torch.device("meta"):
        model = spec.build(args)
    assert isinstance(model, LanguageModel) and isinstance(model.args, ModelArgs)
    assert missing_members(model) == []
    vocab, dim = args.vocab_size, args.dim
    assert tuple(model.tok_embeddings.weight.shape) == (vocab, dim)
    assert isinstance(model.layers, nn.ModuleDict)
    assert list(model.layers) == [str(i) for i in range(args.n_layers)]
    assert isinstance(model.norm, nn.Module)
    if tied:
        assert model.output is None
    else:
        assert tuple(model.output.weight.shape) == (vocab, dim)
    assert args.n_heads % args.n_kv_heads == 0 and args.head_dim > 0
    # set_kv_gather reaches every attention (context parallelism touches nothing else)
    def gather(t, d):
        return t

    model.set_kv_gather(gather)
    attentions = [m for m in model.modules() if hasattr(m, "kv_gather") and m is not model]
    assert len(attentions) == args.n_layers and all(m.kv_gather is gather for m in attentions)


def test_the_member_lists_are_the_protocols():
    assert set(MEMBERS) >= {"args", "tok_embeddings", "layers", "norm", "output", "forward",
                            "init_weights", "init_buffers", "set_kv_gather"}
    assert set(ARGS_MEMBERS) >= {"vocab_size", "dim", "n_layers", "max_seq_len",
                                 "tie_embeddings"}


@pytest.mark.parametrize("member", ["layers", "set_kv_gather", "init_buffers", "args.head_dim"])
def test_a_family_that_drops_a_member_is_refused_naming_it(member, monkeypatch):
    """A family's model class without one member: not a LanguageModel, and its spec's build
    is one ValueError naming the member and the contract."""
    base = models.get("llama3")
    if member.startswith("args."):
        field = member.split(".")[1]

        class Args:  # the llama args with one property missing
            def __init__(self, inner):
                self.__dict__.update({k: getattr(inner, k) for k in ARGS_MEMBERS if k != field})

        def build(args):
            model = base.model_cls(args)
            model.args = Args(args)
            return model
    else:
        class Dropped(base.model_cls):
            pass

        if member == "layers":
            def build(args):
                model = Dropped(args)
                del model.layers
                return model
        else:
            setattr(Dropped, member, property(lambda self: (_ for _ in ()).throw(
                AttributeError(member))))
            build = Dropped
    spec = dataclasses.replace(base, name="dropped", model_cls=build)
    with torch.device("meta"):
        model = build(base.flavors["debug"])
        assert not isinstance(model, LanguageModel) or member.startswith("args.")
        assert missing_members(model) == [member]
        with pytest.raises(ValueError) as e:
            spec.build(base.flavors["debug"])
    assert member in str(e.value) and "'dropped'" in str(e.value)
    assert "contract.py" in str(e.value)


def test_check_model_passes_a_whole_model_through():
    with torch.device("meta"):
        model = models.get("gpt2").model_cls(_debug_args("gpt2"))
    assert check_model(model, "gpt2") is model


def test_peft_names_come_from_each_family_adapter_and_hf_names_no_family():
    from torchllm.hf.peft_names import peft_adapter

    for name, adapter in models.hf_adapters().items():
        if adapter.peft_block is None:
            with pytest.raises(ConfigError) as e:
                peft_adapter(name)
            assert name in str(e.value) and adapter.peft_refusal in str(e.value)
            assert "--adapter" in str(e.value)
            continue
        assert peft_adapter(name) is adapter
        # every LoRA target of the family has a PEFT module name
        with torch.device("meta"):
            model = models.get(name).build(_debug_args(name))
        targets = set(models.get(name).lora_targets)
        linears = {n.split(".", 2)[2] for n, m in model.named_modules()
                   if n.startswith("layers.0.") and n.rsplit(".", 1)[-1] in targets
                   and type(m) is nn.Linear}
        assert linears and linears <= set(adapter.peft_block), name
        assert set(adapter.peft_roots) == {"tok_embeddings", "output"}
    # no string in torchllm/hf/ is a family's name (no per-family table or branch there)
    for path in (REPO / "torchllm" / "hf").glob("*.py"):
        strings = {node.value for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not strings & set(FAMILIES), (path.name, strings & set(FAMILIES))


def test_no_code_outside_models_reaches_a_models_internals():
    """What differs by family goes through a contract method (set_kv_gather, init_buffers), not
    by reading the family's own attributes: none of these names is read outside models/."""
    internals = {"rope_cache", "rope_table", "kv_gather", "pos_embeddings", "block_cls",
                 "attention_cls"}
    found = []
    for path in (REPO / "torchllm").rglob("*.py"):
        if path.relative_to(REPO / "torchllm").parts[0] == "models":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in internals:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
    assert not found, found
