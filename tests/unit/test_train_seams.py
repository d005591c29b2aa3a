"""The loop's seams: callbacks, the run header, eval, report and fault tolerance read the run
through TrainContext (torchllm/callbacks.py), never the Trainer; the train module owns the
training state a checkpoint step holds; the batch carries its processed-token count."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from torchllm.callbacks import Callback, TrainContext
from torchllm.checkpoint.state import JSONState, ModelState, OptimizerState
from torchllm.train import Trainer

from conftest import tiny_config

PACKAGE = Path(__file__).resolve().parents[2] / "torchllm"
LOOP = "train.py"  # the one module that holds the Trainer
# Modules handed the context outside the callback interface (ft attaches, the header).
READERS = ("metrics/header.py", "ft/identity.py", "ft/replicas.py")
CONTEXT_NAMES = ({f.name for f in dataclasses.fields(TrainContext)}
                 | {n for n, v in vars(TrainContext).items() if isinstance(v, property)})


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != LOOP:
            yield rel, ast.parse(path.read_text(encoding="utf-8"))


def _reads_the_context(rel: str, tree: ast.Module) -> bool:
    imports = any(isinstance(n, ast.ImportFrom) and n.module == "torchllm.callbacks"
                  for n in ast.walk(tree))
    return imports or rel in READERS


def trainer_reads(package_sources) -> list[str]:
    """Where a module other than the loop reads the Trainer: a name `trainer` (a parameter,
    a variable, an attribute read or a getattr probe), a `from_trainer` constructor, or, in a
    module handed the context, a `ctx.X` that TrainContext does not name."""
    found = []
    for rel, tree in package_sources:
        context = _reads_the_context(rel, tree)
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.arg) and node.arg == "trainer":
                found.append(f"{where}: parameter trainer")
            elif isinstance(node, ast.Name) and node.id == "trainer":
                found.append(f"{where}: name trainer")
            elif isinstance(node, ast.FunctionDef) and node.name == "from_trainer":
                found.append(f"{where}: from_trainer")
            elif (context and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "ctx" and node.attr not in CONTEXT_NAMES):
                found.append(f"{where}: ctx.{node.attr} (not a TrainContext field)")
    return found


def test_no_module_outside_the_loop_reads_the_trainer():
    assert trainer_reads(_sources()) == []


def test_the_check_finds_a_trainer_read_and_an_unnamed_context_read():
    """The check above bites: a callback that reads the Trainer, or a context field that does
    not exist (the Trainer's `evaluator`), is reported with its place."""
    code = ("from torchllm.callbacks import Callback\n"
            "class C(Callback):\n"
            "    def on_step_end(self, ctx, step, metrics):\n"
            "        return ctx.evaluator, ctx.cfg\n"
            "def header(trainer):\n"
            "    return getattr(trainer, 'val_batches', None)\n")
    found = trainer_reads([("metrics/new.py", ast.parse(code))])
    assert any("metrics/new.py:4: ctx.evaluator" in f for f in found), found
    assert any("metrics/new.py:5: parameter trainer" in f for f in found), found
    assert not any("ctx.cfg" in f for f in found)


class Spy(Callback):
    """Records what each event was handed."""

    seen: list = []

    @classmethod
    def from_context(cls, ctx):
        cls.seen.append(("from_context", ctx))
        return cls()

    def on_train_start(self, ctx):
        self.seen.append(("on_train_start", ctx))

    def on_step_end(self, ctx, step, metrics):
        self.seen.append(("on_step_end", ctx))

    def on_train_end(self, ctx):
        self.seen.append(("on_train_end", ctx))


def test_callbacks_receive_the_frozen_context_only(tmp_path, monkeypatch):
    import torchllm.train as train

    Spy.seen = []
    monkeypatch.setattr(train, "CALLBACKS", (*train.CALLBACKS, Spy))
    trainer = Trainer(tiny_config(tmp_path, "--training.steps=2"))
    trainer.train()
    events = [name for name, _ in Spy.seen]
    assert events == ["from_context", "on_train_start", "on_step_end", "on_step_end",
                      "on_train_end"]
    assert all(type(ctx) is TrainContext for _, ctx in Spy.seen)
    ctx = Spy.seen[-1][1]
    assert ctx.step == 2 and ctx.header and ctx.module is trainer.module
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.cfg = None


def test_the_train_module_state_is_what_a_checkpoint_step_holds(tmp_path):
    """state_dict() holds model, optimizer and LR schedule under a checkpoint step's keys, as
    the checkpoint's own wrappers write them; load_state_dict() restores a copy exactly."""
    a = Trainer(tiny_config(tmp_path / "a", "--training.steps=2"))
    a.train()
    sd = a.module.state_dict()
    assert set(sd) == {"model", "optimizer", "lr_scheduler"}
    assert sd["lr_scheduler"] == JSONState(a.lr_scheduler).state_dict()
    assert sd["optimizer"].keys() == OptimizerState(a.model, a.optimizer).state_dict().keys()
    b = Trainer(tiny_config(tmp_path / "b", "--training.steps=2"))
    b.module.load_state_dict(sd)
    for name, value in ModelState(b.model).state_dict().items():
        torch.testing.assert_close(value, sd["model"][name], rtol=0, atol=0)
    assert b.lr_scheduler.last_epoch == a.lr_scheduler.last_epoch == 2
    b.close()


def test_each_batch_carries_its_processed_token_count(tmp_path):
    trainer = Trainer(tiny_config(tmp_path))
    batch = next(trainer.batches)
    assert int(batch["processed_tokens"]) == batch["inputs"].numel()
    trainer.close()
