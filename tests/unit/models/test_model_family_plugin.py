"""A model family from a folder outside torchllm (tests/toy_family: Llama with a fused gate-up
MLP) is one folder plus one `register` line: through `job.custom_import` it trains with
`python -m torchllm.train`, exports with `python -m torchllm.hf export`, and the
export loads in transformers' LlamaForCausalLM with our logits (the independent oracle)."""

from __future__ import annotations

import sys

import pytest
import torch

from cli import run_module
from conftest import REPO, tiny_args

transformers = pytest.importorskip("transformers")

VOCAB = 512  # data.tokenizer_vocab_size of tiny_args


def _run(module: str, *args: str) -> None:
    """`python -m MODULE ARGS` (in this process: tests/cli.py; tests/ is on sys.path)."""
    proc = run_module(module, *args)
    assert proc.returncode == 0, proc.out[-4000:]


@pytest.fixture
def toy_importable(monkeypatch):
    """tests/ importable, and the toy family registered (when a config imports it) on a copy of
    the registry, forgotten afterwards: later tests see only the built-in families."""
    from torchllm.config import components
    from torchllm.models import registry

    components.builtin()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(components, "_OWN", {s: dict(e) for s, e in components._OWN.items()})
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "toy_family"]:
        del sys.modules[name]


@pytest.mark.slow
def test_toy_family_trains_exports_and_loads_in_transformers(tmp_path, toy_importable):
    _run("torchllm.train", *tiny_args(tmp_path, "--job.custom_import=toy_family",
                                      "--model.name=toy_llama", "--checkpoint.enable",
                                      "--job.run_name=run", "--training.steps=2"))
    out = tmp_path / "hf"
    # A checkpoint's config never imports code: the user's command names the family's module.
    _run("torchllm.hf", "export", "--checkpoint", str(tmp_path / "run"), "--out", str(out),
         "--job.custom_import=toy_family")

    from torchllm.eval.generation import generate
    from torchllm.eval.loading import load_for_inference

    model, cfg, _ = load_for_inference(tmp_path / "run", "cpu", ["--job.custom_import=toy_family"])
    assert type(model).__name__ == "ToyTransformer" and cfg.job.custom_import == "toy_family"
    assert "layers.0.feed_forward.w13.weight" in model.state_dict()
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x)[..., :VOCAB], hf(x).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    # Generation decodes with the family's declared cache: equal to rerunning the prefix.
    prompts = [[1, 5, 9], [1, 7]]
    assert generate(model, prompts, 6) == generate(model, prompts, 6, use_cache=False)


def test_a_family_without_a_tp_plan_refuses_tensor_parallelism(tmp_path, toy_importable):
    from torchllm.config import ConfigError
    from torchllm.config.loader import load_config
    from builders.models import layout_dims
    from torchllm.models import model_args

    cfg = load_config(tiny_args(tmp_path, "--job.custom_import=toy_family",
                                "--model.name=toy_llama", "--parallelism.tensor_parallel_degree=2"))
    with pytest.raises(ConfigError, match="tensor_parallel_degree = 1"):
        layout_dims(cfg, 2, "cpu", model_args(cfg.model, cfg.training, cfg.data, VOCAB))


def test_custom_import_that_fails_names_the_key(tmp_path):
    from torchllm.config import ConfigError
    from torchllm.config.loader import load_config

    with pytest.raises(ConfigError, match=r"job.custom_import = 'no_such_family_module'"):
        load_config(tiny_args(tmp_path, "--job.custom_import=no_such_family_module"))
