"""A Hugging Face folder is read through one Store (torchllm/hf_folder.py), and a bad one is a
line, not a traceback (issue 61, items 3 and 15): `hf import` and `checkpoint.initial_load_in_hf`
read only plain files inside the folder (a shard the index names `../x` or `/abs/x`, or a link,
is refused naming the index and the name, exit 2), its JSON files are bounded and a too deeply
nested one is named; a garbage `tokenizer_config.json` is named; `hf export` refuses a complex
or quantized tensor naming it, and replaces a link planted in `--out`, never writing through it.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from torchllm import models
from torchllm.hf.files import save_seed_checkpoint
from torchllm.hf.folder import write_hf_weights
from torchllm.models import adapter_for_model

from cli import run_module, run_train
from conftest import build_model, tiny_args, tiny_config
from messages import refused

FAMILY = ("--model.name=qwen3",)  # its conversion reshapes nothing: fast to build and convert
VOCAB = 512
INDEX = "model.safetensors.index.json"


def import_args(tmp_path, hf: Path, out: Path, *extra: str) -> list[str]:
    return ["import", "--hf", str(hf), "--out", str(out), *tiny_args(tmp_path, *FAMILY), *extra]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(the qwen3 debug model's HF tensors, its config.json, its args, the torchllm weights)."""
    tmp = tmp_path_factory.mktemp("src")
    cfg = tiny_config(tmp, *FAMILY)
    args = models.model_args(cfg.model, cfg.training, cfg.data, VOCAB)
    model = build_model(models.get("qwen3").model_cls, args)
    adapter = adapter_for_model("qwen3")
    return adapter.to_hf(model.state_dict(), args, VOCAB), adapter.config(args, VOCAB), \
        model.state_dict()


def hf_folder(root: Path, source, shard_name: str | None = None) -> Path:
    """root/hf: config.json and an index listing every tensor in `shard_name`; the real shard
    is written at root/secret/model.safetensors (outside the folder)."""
    tensors, config, _ = source
    hf, secret = root / "hf", root / "secret"
    hf.mkdir(parents=True)
    secret.mkdir(exist_ok=True)
    write_hf_weights(tensors, secret, 10**9)
    (hf / "config.json").write_text(json.dumps(config))
    if shard_name is not None:
        index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, shard_name)}
        (hf / INDEX).write_text(json.dumps(index))
    return hf


@pytest.mark.parametrize("leading_out", ["../secret/model.safetensors", "ABSOLUTE"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(source, tmp_path, leading_out):
    secret = tmp_path / "secret" / "model.safetensors"
    name = str(secret) if leading_out == "ABSOLUTE" else leading_out
    hf = hf_folder(tmp_path, source, name)
    out = tmp_path / "seeds" / "step-0"
    ran = run_module("torchllm.hf", *import_args(tmp_path, hf, out))
    refused(ran, hf / INDEX, repr(name))  # the index, the name it lists
    assert not out.exists() and not list(out.parent.glob(".step-0*"))


def test_a_linked_shard_or_config_is_refused_not_followed(source, tmp_path):
    hf = hf_folder(tmp_path, source, "model-00001-of-00001.safetensors")
    shard = hf / "model-00001-of-00001.safetensors"  # listed in the index, a link
    shard.symlink_to(tmp_path / "secret" / "model.safetensors")
    out = tmp_path / "seeds" / "step-0"
    refused(run_module("torchllm.hf", *import_args(tmp_path, hf, out)), shard, "link")
    shard.unlink()
    (hf / INDEX).unlink()
    (hf / "model.safetensors").symlink_to(tmp_path / "secret" / "model.safetensors")
    refused(run_module("torchllm.hf", *import_args(tmp_path, hf, out)),
            hf / "model.safetensors", "link")
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors").write_bytes((tmp_path / "secret" / "model.safetensors").read_bytes())
    (tmp_path / "elsewhere.json").write_text((hf / "config.json").read_text())
    (hf / "config.json").unlink()
    (hf / "config.json").symlink_to(tmp_path / "elsewhere.json")
    refused(run_module("torchllm.hf", *import_args(tmp_path, hf, out)), hf / "config.json", "link")
    assert not out.exists()


def test_initial_load_in_hf_refuses_a_shard_outside_the_folder(source, tmp_path):
    """The same index through run_train: one line, exit 2, no training from the outside file."""
    hf = hf_folder(tmp_path, source, "../secret/model.safetensors")
    ran = run_train(*tiny_args(tmp_path, *FAMILY, f"--checkpoint.initial_load_path={hf}",
                               "--checkpoint.initial_load_in_hf", "--data.tokenizer=bytes",
                               f"--model.vocab_size={VOCAB}", "--training.steps=1"))
    refused(ran, hf / INDEX, "'../secret/model.safetensors'")


def test_initial_load_in_hf_refuses_a_linked_tokenizer_file(source, tmp_path):
    """The folder's tokenizer (data.tokenizer = 'auto' takes it) is read through the store too."""
    hf = hf_folder(tmp_path, source)
    (hf / "model.safetensors").write_bytes((tmp_path / "secret" / "model.safetensors").read_bytes())
    tokenizer_json(tmp_path / "secret" / "tokenizer.json")
    (hf / "tokenizer.json").symlink_to(tmp_path / "secret" / "tokenizer.json")
    ran = run_train(*tiny_args(tmp_path, *FAMILY, f"--checkpoint.initial_load_path={hf}",
                               "--checkpoint.initial_load_in_hf", f"--model.vocab_size={VOCAB}",
                               "--training.steps=1"))
    refused(ran, hf / "tokenizer.json", "link")


NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("file", ["config.json", INDEX])
def test_a_deeply_nested_json_file_is_named(source, tmp_path, file):
    hf = hf_folder(tmp_path, source, "model.safetensors")
    (hf / "model.safetensors").write_bytes((tmp_path / "secret" / "model.safetensors").read_bytes())
    (hf / file).write_text('{"a": ' + NESTED + "}")
    out = tmp_path / "seeds" / "step-0"
    refused(run_module("torchllm.hf", *import_args(tmp_path, hf, out)), hf / file)
    assert not out.exists()


def test_an_oversized_index_is_refused_before_it_is_read(source, tmp_path, monkeypatch):
    import torchllm.hf_folder as reading

    hf = hf_folder(tmp_path, source, "model.safetensors")
    monkeypatch.setattr(reading, "JSON_MAX", (hf / INDEX).stat().st_size - 1)
    out = tmp_path / "seeds" / "step-0"
    refused(run_module("torchllm.hf", *import_args(tmp_path, hf, out)), hf / INDEX,
            f"{(hf / INDEX).stat().st_size:,} bytes")


def tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # a token a word: texts have many
    tok.save(str(path))


@pytest.mark.parametrize("kind,config", [
    ("tokenizer.json", "{not json"), ("tokenizer.model", "{not json"),
    ("tokenizer.model", '{"added_tokens_decoder": [1, 2]}')])
def test_a_garbage_tokenizer_config_is_named(source, tmp_path, kind, config):
    hf = hf_folder(tmp_path, source)
    (hf / "model.safetensors").write_bytes((tmp_path / "secret" / "model.safetensors").read_bytes())
    if kind == "tokenizer.json":
        tokenizer_json(hf / kind)
    else:
        (hf / kind).write_bytes(Path("/work/shared/tokenizers/mistral-sp32k/tokenizer.model")
                                .read_bytes())
    (hf / "tokenizer_config.json").write_text(config)
    out = tmp_path / "seeds" / "step-0"
    refused(run_module("torchllm.hf", *import_args(tmp_path, hf, out)),
            hf / "tokenizer_config.json")
    assert not out.exists()


EXPORT = ("--job.config_file=./train_configs/debug_model.toml", "--data.tokenizer=bytes",
          f"--model.vocab_size={VOCAB}")


def seed(tmp_path, weights: dict) -> Path:
    step = tmp_path / "ckpt" / "step-0"
    save_seed_checkpoint(weights, step, 0)
    return step


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int8])
def test_export_refuses_a_tensor_that_is_not_a_real_float(source, tmp_path, dtype):
    weights = dict(source[2])
    weights["norm.weight"] = weights["norm.weight"].to(dtype)
    step = seed(tmp_path, weights)
    out = tmp_path / "hf_out"
    ran = run_module("torchllm.hf", "export", "--checkpoint", str(step), "--out", str(out),
                     *tiny_args(tmp_path, *FAMILY, *EXPORT))
    refused(ran, "norm.weight", str(dtype).removeprefix("torch."))
    assert not out.exists()


def test_export_replaces_a_link_planted_in_out_never_writing_through_it(source, tmp_path):
    step = seed(tmp_path, dict(source[2]))
    out, victim = tmp_path / "hf_out", tmp_path / "victim.bin"
    out.mkdir()
    victim.write_bytes(b"mine")
    (out / "model.safetensors").symlink_to(victim)
    (out / "config.json").symlink_to(tmp_path / "absent.json")  # a dangling one too
    ran = run_module("torchllm.hf", "export", "--checkpoint", str(step), "--out", str(out),
                     "--overwrite", *tiny_args(tmp_path, *FAMILY, *EXPORT))
    assert ran.returncode == 0, ran.out[-3000:]
    assert victim.read_bytes() == b"mine" and not (tmp_path / "absent.json").exists()
    assert not os.path.islink(out / "model.safetensors")
    assert not os.path.islink(out / "config.json")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB
