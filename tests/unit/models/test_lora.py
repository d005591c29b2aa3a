"""LoRA fine-tuning ([lora], torchllm/models/lora.py): frozen base, PEFT's init, the shipped
config through ./run_train.sh from a base checkpoint, exact resume, and the exports checked
against peft and transformers (independent implementations of the same model)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from torchllm.checkpoint import open_checkpoint
from torchllm.config import ConfigError, load_config
from torchllm.models.lora import LoRALinear, check_lora, is_adapter_key
from torchllm.train import Trainer

from cli import run_train
from conftest import REPO, build_model, tiny_args
from builders.models import peft_model  # noqa: F401

CONFIG = "train_configs/llama3_debug_sft_lora.toml"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A plain (pre-trained) run's checkpoint: the base every LoRA run here starts from."""
    tmp = tmp_path_factory.mktemp("lora")
    Trainer(load_config(tiny_args(tmp, "--job.run_name=debug_model", "--data.dataset=embedded",
                                  "--training.steps=2", "--checkpoint.enable"))).train()
    return tmp


def lora_args(tmp, name: str, *extra: str) -> list[str]:
    """The shipped LoRA config, tiny, from base_run's checkpoint."""
    return tiny_args(tmp, f"--job.config_file={REPO / CONFIG}", f"--job.run_name={name}",
                     f"--checkpoint.initial_load_path={tmp / 'debug_model'}",
                     "--optimizer.lr=1e-2", "--lr_scheduler.warmup_steps=1", *extra)


def test_adapters_start_as_the_base_model_with_peft_init():
    from torchllm import models
    from torchllm.models.lora import apply_lora, init_weights

    cfg = load_config(["--model.flavor=debug", "--lora.enable", "--model.vocab_size=256"])
    args = models.model_args(cfg.model, cfg.training, cfg.data)
    spec = models.get("llama3")
    plain = build_model(spec.model_cls, args, seed=3)
    with torch.device("meta"):
        lora = spec.build(args)
        wrapped = apply_lora(lora, cfg.lora, cfg.model, cfg.float8.enable)
    lora.to_empty(device="cpu")
    torch.manual_seed(3)
    init_weights(lora)
    assert len(wrapped) == 7 * args.n_layers and "layers.0.attention.wq" in wrapped
    # Base weights keep their names and values (same seed, same draws); only adapters train.
    base = {k: v for k, v in lora.state_dict().items() if not is_adapter_key(k)}
    assert base.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in base.items())
    assert {n for n, p in lora.named_parameters() if p.requires_grad} == {
        n for n in lora.state_dict() if ".lora_" in n}
    tokens = torch.randint(0, 256, (2, 16))
    assert torch.equal(lora(tokens), plain(tokens))  # B = 0: step 0 is the base model
    wq = lora.layers["0"].attention.wq
    assert isinstance(wq, LoRALinear) and wq.scaling == 16 / 8
    assert torch.count_nonzero(wq.lora_B.weight) == 0
    bound = 1 / math.sqrt(wq.in_features)  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), ..)
    a = wq.lora_A.weight
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    assert a.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def test_bad_lora_values_are_one_line_errors_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(["--lora.enable", "--lora.rank=0"])
    assert e.value.key == "lora.rank" and "--lora.rank=0" in str(e.value)
    assert "\n" not in str(e.value)
    cfg = load_config(["--lora.enable", "--lora.target_modules=wq,q_proj"])
    with pytest.raises(ConfigError) as e:
        check_lora(cfg.lora, cfg.model.name, cfg.float8.enable)
    assert e.value.key == "lora.target_modules" and "\n" not in str(e.value)
    # The value refused, and the layers allowed.
    assert "'q_proj'" in str(e.value) and all(
        name in str(e.value) for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    gpt2 = load_config(["--lora.enable", "--model.name=gpt2", "--lora.target_modules=w3"])
    with pytest.raises(ConfigError) as e:
        check_lora(gpt2.lora, gpt2.model.name, gpt2.float8.enable)
    assert e.value.key == "lora.target_modules"
    assert "gpt2" in str(e.value) and "'w3'" in str(e.value)
    from torchllm.train import main

    assert main(tiny_args(tmp_path, "--lora.enable", "--lora.target_modules=gate")) == 2


@pytest.mark.parametrize("flags, key", [
    (["--parallelism.tensor_parallel_degree=2"], "parallelism.tensor_parallel_degree"),
    (["--parallelism.pipeline_parallel_degree=2"], "parallelism.pipeline_parallel_degree"),
    (["--float8.enable", "--float8.emulate"], "float8.enable")], ids=["tp", "pp", "float8"])
def test_lora_with_tp_pp_or_float8_stops_at_the_launcher(tmp_path, capsys, monkeypatch, flags,
                                                         key):
    """run_train.sh's launcher (python -m torchllm.run, 2 processes): one line naming the key,
    exit 2, before any worker starts."""
    from torchllm.run.launch import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (the launcher sets it for 2 processes)

    args = tiny_args(tmp_path, "--lora.enable", "--data.dataset=embedded", *flags)
    assert main(["--nproc_per_node=2", "--nnodes=1", "--standalone", "--", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "lora.enable" in err and key in err and "\n" not in err, err


def train_losses(out: str) -> list[float]:
    return [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines()
            if "| loss " in line]


def run_train_sh(tmp, name: str, *extra: str) -> list[float]:
    """CONFIG_FILE=CONFIG ./run_train.sh ARGS (NGPU=1, in this process): its step losses, after
    checking the header's LoRA line carries the rank, alpha and the two parameter counts."""
    args = lora_args(tmp, name, "--checkpoint.interval=2", *extra)
    args.remove(f"--job.config_file={REPO / CONFIG}")  # (CONFIG_FILE names it)
    r = run_train(*args, config=CONFIG)
    assert r.returncode == 0, r.out[-4000:]
    header = re.sub(r"\s*\n(\[rank0\]:)?\s*", " ", r.out)  # (the header wraps its lines)
    trainable, total = expected_counts(tmp / "debug_model", rank=8)
    (line,) = re.findall(r"LoRA r=8 alpha=16 [^(]*\(", header) or [header[:3000]]
    assert "wq, wk, wv, wo, w1, w2, w3" in line and f"{trainable:,} of {total:,}" in line, line
    return train_losses(r.stdout)


def expected_counts(base_run, rank: int) -> tuple[int, int]:
    """(adapter parameters, all parameters) of the LoRA model on `base_run`'s checkpoint, from
    the base's saved shapes alone: r * (in + out) beside each targeted (out, in) weight."""
    base = open_checkpoint(base_run).weights()
    targets = re.compile(r"layers\.\d+\.(attention|feed_forward)\.(wq|wk|wv|wo|w1|w2|w3)\.weight")
    adapters = sum(rank * sum(w.shape) for k, w in base.items() if targets.fullmatch(k))
    return adapters, adapters + sum(w.numel() for w in base.values())


@pytest.mark.slow
def test_shipped_config_trains_adapters_only_resumes_exactly_and_exports(base_run, capsys):
    """CONFIG_FILE=train_configs/llama3_debug_sft_lora.toml ./run_train.sh from a base
    checkpoint: every base tensor bit-identical after training; two launches (stopped after
    step 2, resumed) give the straight run's losses; the --adapter export in peft and the
    merged export in plain transformers give torchllm's logits."""
    from torchllm.hf.cli import main as hf_main

    straight = run_train_sh(base_run, "straight")
    first = run_train_sh(base_run, "resumed", "--training.stop_after_steps=2")
    assert run_train_sh(base_run, "resumed") == straight[2:] and first == straight[:2]
    assert len(straight) == 4
    assert_same_final_state(base_run / "straight", base_run / "resumed", steps=4)

    base = open_checkpoint(base_run / "debug_model").weights()
    tuned = open_checkpoint(base_run / "straight").weights()
    assert base.keys() == {k for k in tuned if not is_adapter_key(k)}
    assert all(torch.equal(base[k], tuned[k]) for k in base)  # frozen: bit-identical
    assert all(tuned[k].abs().max() > 0 for k in tuned if k.endswith("lora_B.weight"))

    run = base_run / "straight"
    adapter, merged = base_run / "hf_adapter", base_run / "hf_merged"
    assert hf_main(["export", "--checkpoint", str(run), "--out", str(adapter), "--adapter"]) == 0
    assert hf_main(["export", "--checkpoint", str(run), "--out", str(merged)]) == 0
    assert_exports_match(run, adapter, merged)

    from torchllm import generate

    capsys.readouterr()
    assert generate.main(["--checkpoint", str(run), "--prompt", "The", "--max-new-tokens",
                          "3", "--temperature", "0"]) == 0
    assert "### completion 1" in capsys.readouterr().out


def assert_same_final_state(straight, resumed, steps: int) -> None:
    """The two-launch run's last checkpoint equals the straight run's bit for bit: every model
    tensor (frozen base and adapters) and every adapter's AdamW state (exp_avg, exp_avg_sq and
    step, = `steps`); the frozen weights have no optimizer state."""
    a, b = open_checkpoint(straight), open_checkpoint(resumed)
    assert a.step == b.step == steps
    model, other = a.weights(), b.weights()
    adapters = {k for k in model if is_adapter_key(k)}
    assert adapters and other.keys() == model.keys()
    assert all(torch.equal(model[k], other[k]) for k in model)
    moments = a.tensors("optimizer.state.")
    assert moments.keys() == {f"{k}.{m}" for k in adapters for m in ("exp_avg", "exp_avg_sq",
                                                                      "step")}
    theirs = b.tensors("optimizer.state.")
    assert theirs.keys() == moments.keys()
    for key, value in moments.items():
        assert torch.equal(value, theirs[key]), key
        if key.endswith(".step"):
            assert value.item() == steps, key


def assert_exports_match(run, adapter, merged, tol: float = 1e-5):
    """torchllm's LoRA model (as generate and the evals load it) vs peft on the exported base
    + adapter, and vs plain transformers on the merged export (float32); returns torchllm's
    (logits, ids)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"]) == ("LORA", "CAUSAL_LM")
    assert config["base_model_name_or_path"] == "base"  # relative to the adapter folder
    ours, ids = torchllm_logits(run)
    with torch.no_grad():
        with_adapter = peft_model(adapter / "base", adapter)
        assert isinstance(with_adapter.base_model, peft.LoraModel)
        theirs = with_adapter(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        merged_logits = plain(ids).logits
        with with_adapter.disable_adapter():
            without = with_adapter(ids).logits
    assert (ours - theirs).abs().max() < tol
    assert (ours - merged_logits).abs().max() < tol
    assert (ours - without).abs().max() > 100 * tol  # the adapters matter at this tolerance
    return ours, ids


def torchllm_logits(run) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids): torchllm's LoRA model as generate and the evals load it, float32."""
    from torchllm.eval.loading import load_for_inference

    model, _, tok = load_for_inference(run, "cpu")
    ids = torch.randint(0, tok.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids)[..., : tok.vocab_size], ids


@pytest.fixture(scope="module")
def lora_run(base_run):
    """A LoRA run (in-process, 2 steps) from base_run's checkpoint: the adapters moved."""
    Trainer(load_config(lora_args(base_run, "lora", "--training.steps=2", "--lora.dropout=0.1",
                                  "--checkpoint.interval=2"))).train()
    return base_run / "lora"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "llama3_embeddings", "qwen3"])
def test_adapter_and_merged_exports_give_torchllm_logits(base_run, lora_run, family):
    """peft on the --adapter export, and transformers on the merged one, vs torchllm (Llama:
    the RoPE row permutation of wq/wk applies to lora_B; Qwen3: none; lora.train_embeddings:
    the trained tables as PEFT's modules_to_save)."""
    from torchllm.hf.cli import main as hf_main

    run = lora_run
    if family == "llama3_embeddings":  # adapters + whole embedding table and output head
        run = base_run / family
        if not run.exists():
            Trainer(load_config(lora_args(base_run, family, "--lora.train_embeddings",
                                          "--training.steps=2", "--checkpoint.interval=2"))).train()
        base, tuned = (open_checkpoint(r).weights() for r in (base_run / "debug_model", run))
        for key in ("tok_embeddings.weight", "output.weight"):
            assert not torch.equal(base[key], tuned[key]), key  # they trained
    elif family != "llama3":  # a Qwen3 LoRA run on the base run's tokenizer (fresh weights)
        run = base_run / family
        if not run.exists():
            tok = next((base_run / "debug_model" / "data").glob("*.model"))
            Trainer(load_config(lora_args(
                base_run, family, f"--model.name={family}", "--checkpoint.initial_load_path=",
                f"--data.tokenizer={tok}", "--training.steps=2", "--checkpoint.interval=2",
                "--model.flavor=debug"))).train()
    adapter, merged = base_run / f"{family}_adapter", base_run / f"{family}_merged"
    for out, extra in ((adapter, ["--adapter"]), (merged, [])):
        assert hf_main(["export", "--checkpoint", str(run), "--out", str(out), "--overwrite",
                        *extra]) == 0
    ours, ids = assert_exports_match(run, adapter, merged)
    if family == "llama3_embeddings":
        from safetensors.torch import load_file

        config = json.loads((adapter / "adapter_config.json").read_text())
        assert sorted(config["modules_to_save"]) == ["embed_tokens", "lm_head"]
        saved = load_file(adapter / "adapter_model.safetensors")
        assert any("embed_tokens" in k for k in saved) and any("lm_head" in k for k in saved)
        # The adapter alone carries the trained tables: on the *untrained* base (the base
        # run's own export, its original tables) peft still gives torchllm's logits.
        original = base_run / "debug_model_hf"
        if not original.exists():
            assert hf_main(["export", "--checkpoint", str(base_run / "debug_model"), "--out",
                            str(original)]) == 0
        with torch.no_grad():
            theirs = peft_model(original, adapter)(ids).logits
        assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.slow
def test_resume_with_other_lora_settings_is_one_line_naming_the_key(base_run, lora_run):
    for flag, key in (("--lora.rank=4", "lora.rank"),
                      ("--lora.target_modules=wq,wv", "lora.target_modules"),
                      ("--lora.enable=false", "lora.enable"),
                      ("--lora.train_embeddings", "lora.train_embeddings")):
        cfg = load_config(lora_args(base_run, "lora", "--training.steps=3", flag))
        with pytest.raises(ConfigError) as e:
            Trainer(cfg)
        assert f"{key} = " in str(e.value), str(e.value)  # the key, with its saved value
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_memory_estimate_counts_lora_as_the_benchmark_measures(tmp_path):
    """benchmarks/bench_lora_memory.py on a tiny shape: the estimator's params + grads +
    optimizer terms within 10% of the bytes of the real tensors after a step, full and LoRA;
    LoRA's frozen weights have no gradients and no optimizer state."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_lora_memory",
                                                  REPO / "benchmarks" / "bench_lora_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "lora_memory.json"
    result = bench.main(["--dim=64", "--n-layers=2", "--vocab=512", "--seq-len=16",
                         f"--out={out}"])
    assert json.loads(out.read_text()) == result
    full, lora = result["runs"]
    for run in (full, lora):
        assert 0.9 < run["ratio"] < 1.1, run
        for term, measured in run["measured_bytes"].items():
            assert abs(run["estimated_bytes"][term] - measured) <= 0.1 * measured, (term, run)
    assert lora["measured_bytes"]["grads"] == 4 * lora["trainable_params"]
    assert lora["trainable_params"] < full["trainable_params"] / 4
    assert lora["measured_total"] < full["measured_total"] / 2


@pytest.mark.slow
def test_lora_on_two_ranks_matches_one_process(tmp_path):
    """FSDP2 (frozen and trainable parameters in one unit), DDP (only the adapters bucketed),
    and FSDP2 with AC + compile: the losses and grad norms of a single process's LoRA run."""
    from builders.launch import assert_matches, launch, run_reference

    lora = ("--lora.enable", "--lora.rank=4")
    ref = run_reference(tmp_path, *lora)
    runs = {"fsdp": [*lora, "--training.local_batch_size=4"],
            "ddp": [*lora, "--parallelism.dp_mode=ddp", "--training.local_batch_size=4"],
            "fsdp_ac_compiled": [*lora, "--activation_checkpoint.mode=selective",
                                 "--compile.enable", "--compile.backend=aot_eager",
                                 "--training.local_batch_size=2"],  # + 2 accumulation steps
            "fsdp_bf16": [*lora, "--training.mixed_precision=bf16",
                          "--training.local_batch_size=4"]}
    got = launch(tmp_path, 2, runs)
    for name in ("fsdp", "ddp", "fsdp_ac_compiled"):
        assert_matches(got[name], ref, loose=False)
    assert got["fsdp_bf16"]["precision"] == "bf16 FSDP2 params"
    assert got["fsdp_bf16"]["loss"] == pytest.approx(ref["loss"], rel=2e-2)


@pytest.mark.slow
def test_lora_sft_on_conversations_from_a_base_checkpoint(base_run):
    """Chat data (loss on the replies only; the template's tokens grow the base's vocabulary),
    lora.train_embeddings, bf16 autocast, full AC and compile, from base_run's checkpoint: the
    frozen weights stay bit-identical, the adapters and the embedding tables train, and only
    they have optimizer state."""
    from builders.chat import write_chat

    data = write_chat(base_run / "sft.jsonl", [
        [{"role": "user", "content": f"Name a {w}."}, {"role": "assistant", "content": a}]
        for w, a in (("fruit", "An apple."), ("color", "Blue."), ("tool", "A hammer."))] * 4)
    trainer = Trainer(load_config(lora_args(
        base_run, "sft_lora", f"--data.dataset=chat:{data}", "--data.val_fraction=0",
        "--data.chat_packing=pad", "--lora.train_embeddings", "--training.steps=2",
        "--training.mixed_precision=bf16", "--activation_checkpoint.mode=full",
        "--compile.enable", "--compile.backend=aot_eager", "--checkpoint.enable=false")))
    batch = trainer.train_loader.dataset.batch(0)
    assert 0 < int((batch["targets"] != -100).sum()) < batch["targets"].numel() // 2
    trained = {n.replace("_checkpoint_wrapped_module.", "")  # (AC's wrapper: not in state_dict)
               for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained == {n for n in trained if ".lora_" in n} | {"tok_embeddings.weight",
                                                                "output.weight"}
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    losses = trainer.train()
    assert len(losses) == 2 and all(map(math.isfinite, losses)) and trainer.bf16
    after = trainer.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed <= trained  # every frozen tensor bit-identical
    assert {k for k in trained if not k.endswith("lora_A.weight")} <= changed
    state_of = {id(p) for p in trainer.optimizer.state}
    assert state_of == {id(p) for p in trainer.model.parameters() if p.requires_grad}


@pytest.mark.slow
def test_evals_read_a_lora_checkpoint(base_run, lora_run, tmp_path):
    """python -m torchllm.eval.loss on the LoRA run builds the LoRA model from the run's config
    (the adapters load and count: another loss than the base's on the same windows)."""
    from torchllm.eval import loss

    results = {}
    for name, run in (("base", base_run / "debug_model"), ("lora", lora_run)):
        out = tmp_path / f"{name}.json"
        assert loss.main(["--checkpoint", str(run), "--data", "embedded", "--max-tokens", "2000",
                          "--steps", "2", "--device", "cpu", "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert results["lora"]["tokens"] == results["base"]["tokens"] > 0
    assert math.isfinite(results["lora"]["loss"])
    assert abs(results["lora"]["loss"] - results["base"]["loss"]) > 1e-4
