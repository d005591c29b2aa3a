"""The reference configs run offline, without torchdata, torchao, datasets or transformers
(the GPU machines' image), from prepared local files (issue 21, item 7; docs/data.md "Offline").

Each run is a subprocess whose import system refuses those packages and whose sockets refuse
to connect, so any hidden download or module-level import of an optional package fails it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, shared_path
from messages import assert_names, raises_naming

BLOCKED = ("torchdata", "torchao", "datasets", "transformers")
# Runs `torchllm.train.main(argv)` (or imports every module) with BLOCKED unimportable and the
# network unreachable.
RUNNER = f"""
import importlib, pkgutil, socket, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked (offline GPU image)")
        return None

sys.meta_path.insert(0, Blocker())

def no_network(*args, **kwargs):
    raise OSError("network blocked (offline GPU image)")

socket.socket.connect = no_network
socket.create_connection = no_network

if sys.argv[1] == "import-all":
    import torchllm
    for m in pkgutil.walk_packages(torchllm.__path__, "torchllm."):
        importlib.import_module(m.name)
    sys.exit(0)
from torchllm.train import main
if sys.argv[1] == "runs":  # several runs, one after the other: argv = "runs", JSON [argv, ...]
    import json
    for i, argv in enumerate(json.loads(sys.argv[2])):
        print(f"=== run {{i}} ===", flush=True)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        print(f"=== run {{i}} exit {{code}} ===", flush=True)
    sys.exit(0)
sys.exit(main(sys.argv[1:]))
"""


def run_offline(*args: str, merged: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TIKTOKEN_CACHE_DIR": "/nonexistent",
           **({"PYTHONUNBUFFERED": "1"} if merged else {})}  # (one stream, in order)
    return subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                          text=True, timeout=600)


def test_every_module_imports_without_the_optional_packages():
    proc = run_offline("import-all")
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_the_blocker_really_blocks():
    proc = run_offline("--data.dataset=fineweb_edu", "--training.device=cpu")
    assert proc.returncode == 2  # a one-line config error, not a traceback
    assert_names(proc.stdout + proc.stderr, "data.dataset", "HuggingFaceFW/fineweb-edu", "`datasets`",
                 "shards:")  # the key, the dataset it names, the package, what works offline


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Tiny Shakespeare prepared as shards with the GPT-2 and Llama 3 tokenizers (this process
    has `datasets`; the GPU machine gets the folders)."""
    # Its first 300 kB (~80k tokens): enough for the held-out split and a few windows.
    text = tmp_path_factory.mktemp("text") / "tinyshakespeare_300k.txt"
    text.write_bytes(shared_path("data", "tinyshakespeare.txt").read_bytes()[:300_000])
    from torchllm.data.prepare import main as prepare  # its CLI's main, in this process

    out = {}
    for name, tok in (("gpt2", ("gpt2", "gpt2.tiktoken")),
                      ("llama3", ("llama3", "tokenizer.model"))):
        folder = tmp_path_factory.mktemp(f"shards_{name}")
        tokenizer = shared_path("tokenizers", *tok)
        assert prepare([f"--dataset=local:{text}", f"--tokenizer={tokenizer}", f"--out={folder}",
                        "--shard-tokens=200000", "--val-tokens=20000", "--workers=1"]) == 0
        out[name] = (folder, tokenizer)
    return out


# Only the size of the run is shrunk (and compile, which is not about being offline, is off);
# the data, tokenizer and eval settings are the documented offline ones.
SMALL = ("--training.device=cpu", "--model.flavor=debug", "--training.steps=2",
         "--training.seq_len=32", "--training.local_batch_size=2",
         "--training.global_batch_size=2", "--lr_scheduler.warmup_steps=1",
         "--compile.enable=false", "--checkpoint.enable=false", "--job.print_config=false",
         "--metrics.log_freq=1")


CONFIGS = ["debug_model", "gpt2_124m_fineweb", "llama3_1b"]


@pytest.fixture(scope="module")
def offline_runs(shards, tmp_path_factory):
    """Each reference config's run, one after the other in ONE offline process (its start-up
    paid once; a run that imports a blocked package or opens a socket still fails): the
    console output and exit code of each, by config."""
    hellaswag = shared_path("data", "hellaswag_val.jsonl")
    offline = {  # = docs/data.md, "Offline"
        "debug_model": ["--data.tokenizer_vocab_size=512"],
        "gpt2_124m_fineweb": [f"--data.dataset=shards:{shards['gpt2'][0]}",
                              f"--data.tokenizer={shards['gpt2'][1]}",
                              f"--eval.hellaswag_data={hellaswag}", "--data.num_workers=0",
                              "--eval.hellaswag_freq=1", "--eval.hellaswag_limit=2",
                              "--eval.sample_freq=1", "--eval.max_new_tokens=2",
                              "--validation.freq=1", "--validation.steps=1"],
        "llama3_1b": [f"--data.dataset=shards:{shards['llama3'][0]}",
                      f"--data.tokenizer={shards['llama3'][1]}", "--data.num_workers=0"],
    }
    runs = [[f"--job.config_file=train_configs/{config}.toml", *SMALL, *offline[config],
             f"--job.dump_folder={tmp_path_factory.mktemp(config)}"] for config in CONFIGS]
    proc = run_offline("runs", json.dumps(runs), merged=True)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    results = {}
    for i, config in enumerate(CONFIGS):
        start, end = f"=== run {i} ===\n", re.search(rf"=== run {i} exit (\S+) ===", out)
        assert start in out and end, out[-6000:]
        results[config] = (out[out.index(start) + len(start):end.start()], end[1])
    return results


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_reference_config_runs_offline(config, offline_runs):
    out, code = offline_runs[config]
    assert code == "0", out[-6000:]
    assert "done: step 2/2" in out, out[-3000:]


def _window_batches():
    from torchllm.data.token_stream import TokenStream, pack_documents
    from torchllm.data.windows import WindowBatches

    tokens, starts = pack_documents([list(range(i, i + 37)) for i in range(40)])
    return WindowBatches(TokenStream([tokens], starts), seq_len=8, batch_size=2, dp_rank=0,
                         dp_degree=1, seed=3, shuffle_windows=True, name="test")


def test_loader_without_torchdata_resumes_exactly(monkeypatch):
    """Oracle: one uninterrupted pass of torchdata's StatefulDataLoader."""
    import torch

    from torchllm.config import ConfigError
    from torchllm.data import loader

    def batches(train_loader, n):
        it = iter(train_loader)
        return [next(it)["inputs"] for _ in range(n)]

    expected = batches(loader.TrainLoader(_window_batches(), 0, 1, 0, 2, False), 7)
    saved_by_torchdata = loader.TrainLoader(_window_batches(), 0, 1, 0, 2, False)
    batches(saved_by_torchdata, 3)
    torchdata_state = saved_by_torchdata.state_dict()

    monkeypatch.setattr(loader, "_stateful_loader_class", lambda: None)
    first = loader.TrainLoader(_window_batches(), 0, 1, 0, 2, False)
    assert isinstance(first.loader, torch.utils.data.DataLoader)
    got = batches(first, 4)
    state = first.state_dict()
    resumed = loader.TrainLoader(_window_batches(), 0, 1, 0, 2, False)
    resumed.load_state_dict(state)
    got += batches(resumed, 3)
    from_torchdata = loader.TrainLoader(_window_batches(), 0, 1, 0, 2, False)
    from_torchdata.load_state_dict(torchdata_state)  # a run that saved with torchdata
    for a, b in zip(got + batches(from_torchdata, 4), expected + expected[3:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with raises_naming(ConfigError, "data.num_workers = 2", "torchdata", "data.num_workers = 0",
                       key="data.num_workers"):
        loader.TrainLoader(_window_batches(), 0, 1, 2, 2, False)


def test_hub_offline_switch_does_not_import_datasets():
    """An unreachable Hub switches this process offline at once: huggingface_hub's switch, not
    an import of `datasets` (~4 s with pandas, most of the offline error's delay); datasets,
    imported later, copies that switch (its config reads huggingface_hub.constants)."""
    code = (
        "import sys\n"
        "from torchllm.hub import prepare_hub\n"
        "assert prepare_hub() is True\n"
        "import huggingface_hub.constants as c\n"
        "assert c.HF_HUB_OFFLINE is True\n"
        "assert 'datasets' not in sys.modules, 'set_offline imported datasets'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HTTP", "http"))}
    env.update(PYTHONPATH=str(REPO), HF_ENDPOINT="https://hub.invalid")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
