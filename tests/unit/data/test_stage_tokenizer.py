"""data.tokenizer = "from_initial_load" (issue 29's stage seam): a later stage takes the tokenizer
the run at checkpoint.initial_load_path trained with, as its checkpoint records it, through
./run_train.sh and the shipped stage configs; nothing to read it from is one line, exit 2."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from torchllm.run.tokenizer import stage_tokenizer
from torchllm.config import load_config
from torchllm.data.sources.embedded import TINY_SHAKESPEARE
from torchllm.data.tokenizer_training import train_sentencepiece

import cli
from conftest import REPO, tiny_args

MIDTRAIN = "train_configs/llama3_debug_midtrain.toml"
SFT = "train_configs/llama3_debug_sft.toml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_train(tmp_path, *extra, config=cli.DEBUG_CONFIG):
    """./run_train.sh (NGPU=1, in this process: tests/cli.py) on the tiny config, offline."""
    r = cli.run_train(*tiny_args(tmp_path, "--metrics.progress_bar=false"), *extra,
                      config=config, env=OFFLINE)
    return r.returncode, r.out


def tool(module: str, *args: str) -> tuple[int, str]:
    """`python -m torchllm.generate` / `torchllm.hf` (in this process: tests/cli.py), offline."""
    r = cli.run_module(module, *args, env=OFFLINE)
    return r.returncode, r.out


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "error" in line.lower()]


def test_the_shipped_stage_configs_take_the_previous_stages_tokenizer():
    for config in (MIDTRAIN, SFT):
        cfg = load_config([f"--job.config_file={REPO / config}"])
        assert cfg.data.tokenizer == "from_initial_load" and cfg.checkpoint.initial_load_path


def test_without_initial_load_path_it_is_one_line(tmp_path):
    code, out = run_train(tmp_path, "--checkpoint.initial_load_path=", config=SFT)
    assert code == 2, out[-3000:]
    (line,) = error_lines(out)
    assert "data.tokenizer" in line and "'from_initial_load'" in line, out[-3000:]
    assert "checkpoint.initial_load_path" in line and "empty" in line, out[-3000:]


def test_a_checkpoint_that_records_no_tokenizer_is_one_line(tmp_path):
    """A checkpoint written before markers recorded the tokenizer (its COMPLETE has none)."""
    step = tmp_path / "old_run" / "checkpoint" / "step-5"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text(json.dumps({"step": 5, "time": 0}))
    code, out = run_train(tmp_path, f"--checkpoint.initial_load_path={tmp_path / 'old_run'}",
                          config=MIDTRAIN)
    assert code == 2, out[-3000:]
    (line,) = error_lines(out)
    assert str(step / "COMPLETE") in line and "tokenizer" in line, out[-3000:]


# --- issues 42/43: a stage inherits its tokenizer; inference never trains one; one identity
# check (the base file's SHA-256, whatever its size) on resume, initial load and inference. ---

# A 1-block model of width 64: 20 steps learn enough that another tokenizer's ids show in the
# loss, in seconds.
SMALL = ("--model.dim=64", "--model.n_layers=1", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--training.local_batch_size=8", "--eval.sample_freq=0", "--validation.enable=false")
LOSS = re.compile(r"step\s+(\d+)/\d+ \| loss ([\d.]+)")


def losses(out: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS.findall(out)}


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def named(path, hashed, line: str) -> bool:
    """`line` names the tokenizer file `path` and the SHA-256 (its first 12 digits) of `hashed`
    (the test's own hash of the file)."""
    return str(path) in line and sha(hashed)[:12] in line


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 20-step run on the first 200k characters of tiny Shakespeare with its 'auto' tokenizer,
    a 512-piece tokenizer of the same size trained on other text, and that other text (the
    'novel' a next stage trains on)."""
    root = tmp_path_factory.mktemp("stages")
    text = TINY_SHAKESPEARE.read_text()  # shipped with the package: no ../shared needed
    (root / "a.txt").write_text(text[:200_000])
    (root / "novel.txt").write_text(text[600_000:700_000])
    code, out = run_train(root, *SMALL, f"--data.dataset=local:{root / 'a.txt'}",
                          "--job.run_name=base", "--checkpoint.enable=true",
                          "--training.steps=20", "--optimizer.lr=1e-2")
    assert code == 0, out[-3000:]
    (tok,) = (root / "base" / "data").glob("tokenizer_*sp512.model")
    other = train_sentencepiece([(root / "novel.txt").read_text()], 512,
                                root / "other" / "tokenizer.model")
    assert sha(other) != sha(tok)
    return {"root": root, "tok": tok, "other": other, "novel": root / "novel.txt",
            "loss": losses(out)[20]}


@pytest.fixture(scope="module")
def hf_export(base) -> Path:
    """The base run exported to a Hugging Face folder (`python -m torchllm.hf export`, once for
    the tests below)."""
    hf = base["root"] / "hf"
    code, out = tool("torchllm.hf", "export", "--checkpoint", str(base["root"] / "base"),
                     "--out", str(hf))
    assert code == 0, out[-3000:]
    return hf


def stage(base, tmp_path, *extra):
    """run_train.sh: a new run (a stage) on the novel from the base run's weights, 1 step."""
    return run_train(tmp_path, *SMALL, f"--data.dataset=local:{base['novel']}",
                     "--training.steps=1", *extra)


@pytest.mark.slow
def test_run_train_sh_stages_use_the_tokenizer_their_initial_load_trained_with(base, tmp_path):
    """The base run (an 'auto' tokenizer trained on the user's text), then the shipped
    mid-training config with nothing but its data and initial_load_path: the same tokenizer
    file, plus the chat tokens the stage adds (the rows grow), recorded concretely in the
    stage's config."""
    code, out = run_train(tmp_path, *SMALL, f"--data.sources=local:{base['novel']}=1",
                          f"--checkpoint.initial_load_path={base['root'] / 'base'}",
                          "--training.steps=1", config=MIDTRAIN)
    assert code == 0, out[-3000:]
    marker = base["root"] / "base" / "checkpoint" / "step-20" / "COMPLETE"
    assert any("'from_initial_load'" in ln and str(base["tok"]) in ln and str(marker) in ln
               for ln in out.splitlines()), out[-3000:]
    assert any("vocabulary" in ln and "512" in ln and "518" in ln for ln in out.splitlines()), \
        out[-3000:]
    written = tomllib.loads((tmp_path / "debug_midtrain" / "config.toml").read_text())
    assert written["data"]["tokenizer"] == str(base["tok"]) and written["data"]["chat_tokens"]


@pytest.mark.slow
def test_generate_never_trains_a_missing_tokenizer_nor_takes_another(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base["root"] / "base", run)
    (run / "data" / base["tok"].name).unlink()
    prompt = ("--prompt", "ROMEO:", "--max-new-tokens", "4")
    code, out = tool("torchllm.generate", "--checkpoint", str(run), *prompt)
    assert code == 2, out[-3000:]
    (line,) = error_lines(out)
    assert str(run / "data" / base["tok"].name) in line, out[-3000:]
    assert "--data.tokenizer=FILE" in line, line  # the option to name it with
    assert not list(tmp_path.rglob("*.model")) and not list(REPO.glob("*.model"))
    # Another tokenizer of the same size: both named, by file and SHA-256.
    code, out = tool("torchllm.generate", "--checkpoint", str(run), *prompt,
                     f"--data.tokenizer={base['other']}")
    assert code == 2, out[-3000:]
    (line,) = error_lines(out)
    assert named(base['tok'], base['tok'], line), line
    assert named(base['other'], base['other'], line), line
    # The file put back (here: named): it generates.
    code, out = tool("torchllm.generate", "--checkpoint", str(run), *prompt,
                     f"--data.tokenizer={base['tok']}")
    assert code == 0 and "### completion 1" in out, out[-3000:]


@pytest.mark.slow
def test_resuming_with_another_tokenizer_of_the_same_size_names_both(base, tmp_path):
    shutil.copytree(base["root"] / "base", tmp_path / "base")
    code, out = run_train(tmp_path, *SMALL, "--job.run_name=base", "--checkpoint.enable=true",
                          f"--data.dataset=local:{base['root'] / 'a.txt'}",
                          "--training.steps=21", f"--data.tokenizer={base['other']}")
    assert code == 2, out[-3000:]
    line = [ln for ln in error_lines(out) if ln.startswith("run_train:")][-1]
    assert named(base['tok'], base['tok'], line), line
    assert named(base['other'], base['other'], line), line
    assert "data.tokenizer" in line, line
    assert not (tmp_path / "base" / "checkpoint" / "step-21").exists()


@pytest.mark.slow
def test_a_stage_from_a_dcp_checkpoint_with_another_tokenizer_of_the_same_size_names_both(
        base, tmp_path):
    """checkpoint.initial_load_path (a DCP run folder) with another 512-piece tokenizer named in
    data.tokenizer: the rows fit, but the ids mean other tokens; one line naming both files by
    SHA-256, exit 2, nothing trained (the oracle: the test's own hash of each file)."""
    code, out = stage(base, tmp_path, f"--checkpoint.initial_load_path={base['root'] / 'base'}",
                      "--job.run_name=other", "--checkpoint.enable=true",
                      f"--data.tokenizer={base['other']}")
    assert code == 2, out[-3000:]
    line = [ln for ln in error_lines(out) if ln.startswith("run_train:")][-1]
    assert f"checkpoint {base['root'] / 'base' / 'checkpoint' / 'step-20'}" in line, line
    assert named(base['tok'], base['tok'], line), line
    assert named(base['other'], base['other'], line), line
    assert "data.tokenizer = 'train'" in line, line  # the setting that trains a new one
    assert not LOSS.search(out) and not (tmp_path / "other" / "checkpoint").exists(), out[-3000:]


@pytest.mark.slow
def test_a_stage_on_new_data_keeps_its_checkpoints_tokenizer(base, tmp_path):
    """The default ('auto') takes the tokenizer of the weights it starts from: the loss starts
    where the base run ended. 'train' trains a new one on the novel, on purpose: a warning
    naming both, and the ids the weights learnt mean other tokens (a higher loss)."""
    start = f"--checkpoint.initial_load_path={base['root'] / 'base'}"
    code, out = stage(base, tmp_path, start, "--job.run_name=inherit")
    assert code == 0, out[-3000:]
    assert any("'auto'" in ln and "checkpoint.initial_load_path" in ln and str(base["tok"]) in ln
               for ln in out.splitlines()), out[-3000:]
    assert not (tmp_path / "inherit" / "data").exists()  # no tokenizer trained
    written = tomllib.loads((tmp_path / "inherit" / "config.toml").read_text())
    assert written["data"]["tokenizer"] == str(base["tok"])
    inherited = losses(out)[1]
    assert abs(inherited - base["loss"]) < 0.3, (inherited, base["loss"])

    code, out = stage(base, tmp_path, start, "--job.run_name=new", "--data.tokenizer=train")
    assert code == 0, out[-3000:]
    (new,) = (tmp_path / "new" / "data").glob("tokenizer_*sp512.model")
    (warning,) = [ln for ln in out.splitlines() if str(new) in ln and "'train'" in ln]
    assert named(base['tok'], base['tok'], warning)
    assert named(new, new, warning)
    assert losses(out)[1] > inherited + 0.3, (losses(out)[1], inherited)


@pytest.mark.slow
def test_a_stage_from_a_hugging_face_export_keeps_its_tokenizer(base, hf_export, tmp_path):
    hf = hf_export
    assert sha(hf / "tokenizer.model") == sha(base["tok"])
    start = (f"--checkpoint.initial_load_path={hf}", "--checkpoint.initial_load_in_hf=true")
    code, out = stage(base, tmp_path, *start, "--job.run_name=from_hf")
    assert code == 0, out[-3000:]
    assert any("checkpoint.initial_load_path" in ln and str(hf / "tokenizer.model") in ln
               for ln in out.splitlines()), out[-3000:]
    assert not (tmp_path / "from_hf" / "data").exists()
    assert abs(losses(out)[1] - base["loss"]) < 0.3, (losses(out), base["loss"])
    # Another tokenizer of the same size named with the HF weights: one line naming both.
    code, out = stage(base, tmp_path, *start, "--job.run_name=other",
                      f"--data.tokenizer={base['other']}")
    assert code == 2, out[-3000:]
    line = [ln for ln in error_lines(out) if ln.startswith("run_train:")][-1]
    assert named(hf / 'tokenizer.model', base['tok'], line), line
    assert named(base['other'], base['other'], line), line


@pytest.mark.slow
def test_hf_import_writes_a_seed_that_generates_and_passes_its_tokenizer_on(base, hf_export,
                                                                            tmp_path):
    hf, seed = tmp_path / "hf", tmp_path / "seeds" / "debug" / "step-0"
    run = base["root"] / "base"
    shutil.copytree(hf_export, hf)  # the module's export, a copy this test may remove
    code, out = tool("torchllm.hf", "import", "--hf", str(hf), "--out", str(seed),
                     f"--job.config_file={run / 'config.toml'}")
    assert code == 0, out[-3000:]
    assert sha(seed / "tokenizer.model") == sha(base["tok"])  # the seed carries its own copy
    shutil.rmtree(hf)  # and needs nothing from the folder it came from
    # The seed generates what its run generates (the same weights and tokenizer).
    prompt = ("--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0")
    code, from_seed = tool("torchllm.generate", "--checkpoint", str(seed), *prompt)
    assert code == 0, from_seed[-3000:]
    code, from_run = tool("torchllm.generate", "--checkpoint", str(run), *prompt)
    assert code == 0 and from_seed.split("### completion 1")[1] == \
        from_run.split("### completion 1")[1], (from_seed, from_run)
    # A stage from the seed takes its tokenizer: the copy, as the seed's marker records it.
    cfg = load_config(tiny_args(tmp_path, "--data.tokenizer=from_initial_load",
                                f"--checkpoint.initial_load_path={seed}"))
    data = stage_tokenizer(cfg.data, cfg.checkpoint)
    assert data.tokenizer == str(seed / "tokenizer.model") and not data.chat_tokens


def word_tokenizer_json(path: Path, words: list[str]) -> Path:
    """A real tokenizer.json (a `tokenizers` WordLevel model): <s>, </s>, then `words`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def test_a_hub_name_against_a_file_is_compared_by_the_cached_copy_or_refused(tmp_path,
                                                                             monkeypatch):
    """A checkpoint trained with a tokenizer.json file, then a Hub name of the same size (and
    the other way round): the Hub repo's tokenizer.json in the local cache (the layout `hf
    download` writes) is compared by SHA-256: a byte-identical copy passes, another file is one
    line naming both, and a name with nothing cached is one line saying how to compare."""
    import huggingface_hub.constants

    from torchllm.checkpoint.stage.tokenizer_identity import check_same_tokenizer, tokenizer_record
    from torchllm.config.job_config import ConfigError
    from torchllm.data.tokenizer import load_tokenizer

    cache = tmp_path / "hub"
    for repo, words in (("org/same", [f"w{i}" for i in range(510)]),
                        ("org/other", [f"v{i}" for i in range(510)])):
        folder = cache / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text("0" * 40)
        word_tokenizer_json(folder / "snapshots" / ("0" * 40) / "tokenizer.json", words)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    local = word_tokenizer_json(tmp_path / "assets" / "tokenizer.json",
                                [f"w{i}" for i in range(510)])
    file = tokenizer_record(load_tokenizer(local))
    same, other = (tokenizer_record(load_tokenizer(n)) for n in ("org/same", "org/other"))
    assert file["base_sha256"] == sha(local) and same["base_sha256"] is None
    assert file["vocab_size"] == same["vocab_size"] == other["vocab_size"] == 512
    for use in ("resume", "initial load", "inference"):
        check_same_tokenizer(file, same, "checkpoint C", use)
        check_same_tokenizer(same, file, "checkpoint C", use)
    for saved, now in ((file, other), (other, file)):
        with pytest.raises(ConfigError) as err:
            check_same_tokenizer(saved, now, "checkpoint C", "resume")
        msg = str(err.value)
        assert "\n" not in msg and "org/other" in msg, msg
        assert named(local, local, msg), msg
    missing = {**same, "name": "org/gone"}
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(file, missing, "checkpoint C", "initial load")
    msg = str(err.value)
    assert "\n" not in msg and named(local, local, msg), msg
    assert "`hf download org/gone tokenizer.json`" in msg, msg  # the command that fetches it
