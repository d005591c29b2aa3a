"""lm-evaluation-harness on torchllm checkpoints (torchllm.eval.harness): per-request scores
against lm-eval's own `hf` model on the HF export, predictions against torchllm.eval.downstream,
2 ranks == 1, generate_until against brute-force greedy decoding, the CLI, and the one line
a missing lm-eval gives."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TORCHRUN, shared_path, tiny_config
from builders.eval import tiny_model, tokenizer  # noqa: F401 (fixture)
from messages import assert_names

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[test])")

from lm_eval.api.instance import Instance  # noqa: E402

from torchllm.eval.harness.data import TASKS_DIR, resolve_sources  # noqa: E402
from torchllm.eval.harness.model import TorchllmLM  # noqa: E402

CPU = torch.device("cpu")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short debug-model run (auto SentencePiece tokenizer, fp32) and its HF export:
    (run folder, HF folder, model, tokenizer) with the model loaded as the CLI loads it."""
    shared_path("data", "evals")
    from torchllm.hf.export import export_hf
    from torchllm.eval.loading import load_for_inference
    from torchllm.train import Trainer

    tmp = tmp_path_factory.mktemp("harness")
    trainer = Trainer(tiny_config(
        tmp, "--checkpoint.enable", "--job.run_name=run", "--training.steps=20",
        "--training.seq_len=64", "--model.max_seq_len=1024", "--optimizer.lr=3e-3",
        "--model.dim=128", "--model.n_layers=2"))  # (GQA kept) a quarter of the debug's compute
    try:
        trainer.train()
    finally:
        trainer.close()
    export_hf(tmp / "run", tmp / "hf")
    model, _, tokenizer = load_for_inference(tmp / "run", CPU)
    return tmp / "run", tmp / "hf", model, tokenizer


@functools.lru_cache(maxsize=None)
def _loaded_task(name: str):
    """A shipped offline task, loaded once per module (HellaSwag's: ~5 CPU-s)."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                          metadata=resolve_sources(None))
    return manager.load([name])["tasks"][name]


@functools.lru_cache(maxsize=None)
def _requests(name: str, limit: int) -> tuple[Instance, ...]:
    task = _loaded_task(name)
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return tuple(task.instances)


def task_requests(name: str, limit: int) -> tuple[object, list[Instance]]:
    """(task, its requests for the first `limit` documents) of a shipped offline task (the
    requests built once per module; each caller gets its own copies)."""
    return _loaded_task(name), copy.deepcopy(list(_requests(name, limit)))


def rolling_requests(limit: int) -> list[Instance]:
    """loglikelihood_rolling requests over HellaSwag documents (context and all endings)."""
    docs = itertools.islice(_loaded_task("hellaswag_local").validation_docs(), limit)
    return [Instance("loglikelihood_rolling", doc, (doc["ctx"] + " " + " ".join(doc["endings"]),),
                     i) for i, doc in enumerate(docs)]


# --- (a) per-request scores == lm-eval's hf model on the HF export -----------------------------

MAX_LENGTH = 48  # short: long contexts are left-truncated and texts span several windows


@pytest.mark.slow
def test_requests_equal_lm_eval_hf_model_on_the_export(trained):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import get_rolling_token_windows

    run, hf_dir, model, tok = trained
    ours = TorchllmLM(model, tok, CPU, batch_size=5, max_length=MAX_LENGTH)
    hf = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=7,
              max_length=MAX_LENGTH, add_bos_token=True, logits_cache=False)

    _, requests = task_requests("arc_easy_local", 12)
    mine, theirs = ours.loglikelihood(requests), hf.loglikelihood(requests)
    assert len(mine) == len(theirs) == len(requests) > 40
    for i, ((a, greedy_a), (b, greedy_b)) in enumerate(zip(mine, theirs)):
        assert abs(a - b) < 1e-4, (i, requests[i].args, a, b)
        assert greedy_a == greedy_b, i
    # Exercised: contexts cut on the left (pairs longer than max_length + 1 tokens).
    long = [r for r in requests if sum(map(len, ours._encode_pair(*r.args))) > MAX_LENGTH + 1]
    assert 0 < len(long) < len(requests)

    # Rolling: HFLM without its tokenizer's BOS (with it, it scores a second BOS after the
    # prefix one); both condition the first window on BOS.
    hf.add_bos_token = False
    rolling = rolling_requests(6)
    mine, theirs = ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert abs(a - b) < 1e-4, (i, a, b)
    windows = [len(list(get_rolling_token_windows(tok.encode(r.args[0]), tok.bos_id, MAX_LENGTH,
                                                  1))) for r in rolling]
    assert min(windows) >= 2, windows  # several windows per text

    # A continuation longer than max_length (where HFLM fails) is scored in the same disjoint
    # windows: after an empty context (BOS) it is the rolling score of its text.
    long_cont = [Instance("loglikelihood", r.doc, ("", r.args[0]), r.idx) for r in rolling]
    windowed = ours.loglikelihood(long_cont)
    for i, ((a, _), b) in enumerate(zip(windowed, mine)):
        assert abs(a - b) < 1e-4, (i, a, b)


# --- (b) the same questions as torchllm.eval.downstream ----------------------------------------

def evaluate_in_process(lm, tasks: list[str], limit: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                          metadata=resolve_sources(None))
    return simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                           log_samples=True)


@pytest.mark.slow
def test_predictions_equal_downstream_where_the_formats_agree(trained):
    """ARC-Easy, PIQA and Winogrande: downstream's prompts are lm-eval's ("Question: ...
    Answer:" + " " + choice; the blank filled with each option + the rest of the sentence), so
    each option's log-likelihood is minus downstream's summed loss, and lm-eval's `acc` picks
    downstream's lowest summed loss. Downstream's own pick is the lowest mean loss per token:
    the same question for Winogrande (one shared continuation), not for the others."""
    from torchllm.eval import downstream
    from torchllm.eval.continuation import encode_continuation
    from torchllm.eval.tasks import load_items

    _, _, model, tok = trained
    n = 10
    lm = TorchllmLM(model, tok, CPU, batch_size=6)
    results = evaluate_in_process(lm, ["arc_easy_local", "piqa_local", "winogrande_local"], n)
    data_dir = resolve_sources(None)["data_dir"]
    for name in ("arc_easy", "piqa", "winogrande"):
        items = load_items(name, data_dir)[:n]
        ref = downstream.evaluate_task(model, tok, name, items, 0, CPU, batch_size=4)
        samples = sorted(results["samples"][f"{name}_local"], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in samples] == list(range(n))
        for item, s, p in zip(items, samples, ref.predictions):
            ll = [r[0][0] for r in s["resps"]]
            counts = [len(encode_continuation(tok, *item.option(j))[1])
                      for j in range(item.num_options)]
            summed = [m * c for m, c in zip(p["mean_loss"], counts)]
            assert max(abs(a + b) for a, b in zip(ll, summed)) < 1e-4, (name, s["doc_id"])
            pred = max(range(len(ll)), key=ll.__getitem__)
            assert s["acc"] == float(pred == item.gold)
            assert pred == min(range(len(summed)), key=summed.__getitem__), (name, s["doc_id"])
            if name == "winogrande":
                assert pred == p["pred"], s["doc_id"]
        if name == "winogrande":
            assert results["results"]["winogrande_local"]["acc,none"] == ref.acc


# --- (d) generate_until ------------------------------------------------------------------------

def greedy_text(model, tok, prompt: list[int], n: int) -> str:
    """Independent reference: n greedy tokens, one full forward per token, cut at EOS."""
    from torchllm.eval.generation import completion_text

    out = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
            if out[-1] == tok.eos_id:
                break
    return completion_text(tok, prompt, out[len(prompt):])


def test_generate_until_stops_at_stop_sequences_and_equals_greedy_decoding(tokenizer):
    model, tok = tiny_model(max_seq_len=160, seed=3), tokenizer  # varied text, not one word
    contexts = ["Question: What is the capital of France?\nAnswer:", "The meaning of life is",
                "def f(x):\n    return", "Python"]
    n = 12
    full = [greedy_text(model, tok, tok.encode(c, bos=True), n) for c in contexts]
    requests, expected = [], []
    for i, (c, text) in enumerate(zip(contexts, full)):
        stripped = text.strip()
        assert len(stripped) >= 4, text
        stop = stripped[len(stripped) // 2 : len(stripped) // 2 + 2]  # from its own middle
        until = [stop] if i % 2 == 0 else [stop, "never-generated"]
        requests.append(Instance("generate_until", {}, (c, {"until": until, "max_gen_toks": n}),
                                 0))
        expected.append(text.split(stop)[0])
        assert len(expected[-1]) < len(text)  # the stop sequence is really generated
    requests.append(Instance("generate_until", {}, (contexts[0], {"until": [], "max_gen_toks": n}),
                             0))
    expected.append(full[0])
    lm = TorchllmLM(model, tok, CPU, batch_size=3)  # prompts of 4 lengths over 2 batches
    assert lm.generate_until(requests) == expected
    # A request stops generating once its stop sequence is out (not after max_gen_toks).
    steps = []
    hook = model.register_forward_pre_hook(lambda *_: steps.append(1))
    try:
        assert lm.generate_until(requests[:1]) == expected[:1]
    finally:
        hook.remove()
    assert len(steps) < n, len(steps)


# --- (c) 2 ranks == 1 rank, and (e) the CLI ----------------------------------------------------

def run_cli(run, out, *extra: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launch = ([*TORCHRUN, "--standalone",
               f"--nproc_per_node={ranks}", "-m"] if ranks > 1 else [sys.executable, "-m"])
    return subprocess.run(
        [*launch, "torchllm.eval.harness", "--checkpoint", str(run), "--output_path", str(out),
         "--device", "cpu", *extra], env=ENV, capture_output=True, text=True, timeout=900)


def read_samples(folder, task: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (folder / f"samples_{task}.jsonl").open()]
    return {r["doc_id"]: r for r in rows}


TWO_TASKS = ["arc_easy_local", "winogrande_local"]
CLI_ARGS = ("--tasks", ",".join(TWO_TASKS), "--limit", "7", "--log_samples", "--batch_size", "3")


@pytest.fixture(scope="module")
def one_rank_cli(trained, tmp_path_factory):
    """The CLI on one rank, with TensorBoard logging: (its output folder, the process)."""
    folder = tmp_path_factory.mktemp("ranks1")
    proc = run_cli(trained[0], folder / "results.json", *CLI_ARGS, "--tensorboard")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder, proc


@pytest.mark.slow
def test_two_ranks_equal_one_rank(trained, one_rank_cli, tmp_path):
    folder = tmp_path / "ranks2"
    proc = run_cli(trained[0], folder / "results.json", *CLI_ARGS, ranks=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = {1: one_rank_cli[0], 2: folder}
    one, two = (json.loads((outs[r] / "results.json").read_text()) for r in (1, 2))
    for task in TWO_TASKS:
        assert one["n-samples"][task]["effective"] == two["n-samples"][task]["effective"] == 7
        for key, value in one["results"][task].items():
            assert two["results"][task][key] == pytest.approx(value, abs=1e-12), (task, key)
        a, b = read_samples(outs[1], task), read_samples(outs[2], task)
        assert sorted(a) == sorted(b) == list(range(7))  # rank 1's documents came back
        for doc_id in a:
            la = [r[0][0] for r in a[doc_id]["resps"]]
            lb = [r[0][0] for r in b[doc_id]["resps"]]
            assert la == pytest.approx(lb, abs=1e-5), (task, doc_id)


@pytest.mark.slow
def test_cli_prints_the_table_writes_json_and_logs_to_tensorboard(trained, one_rank_cli):
    run = trained[0]
    folder, proc = one_rank_cli
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table[0].split("|")[1].strip() == "Tasks"
    rows, task = {}, ""
    for line in table[2:]:  # a task's later metric rows leave its name blank
        task = line.split("|")[1].strip() or task
        rows[(task, line.split("|")[5].strip())] = line
    assert {("arc_easy_local", "acc"), ("arc_easy_local", "acc_norm"),
            ("winogrande_local", "acc")} <= set(rows)
    result = json.loads((folder / "results.json").read_text())  # lm-eval's results format
    metrics = result["results"]["arc_easy_local"]
    assert {"acc,none", "acc_stderr,none", "acc_norm,none"} <= set(metrics)
    assert result["n-samples"]["arc_easy_local"]["effective"] == 7
    assert result["config"]["model"] == "torchllm"
    assert result["config"]["model_args"]["step"] == 20
    acc = rows[("arc_easy_local", "acc")]
    assert float(acc.split("|")[7]) == pytest.approx(metrics["acc,none"], abs=1e-4)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.parent / "tb" / "run"))
    events.Reload()
    for task in TWO_TASKS:
        logged = events.Scalars(f"harness/{task}/acc")
        expected = result["results"][task]["acc,none"]
        assert [(e.step, e.value) for e in logged] == [(20, pytest.approx(expected))], task


def test_unknown_task_and_bad_option_are_one_line(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from lm_eval.tasks import manager
    from builders.eval import write_run

    from torchllm.eval.harness.cli import main

    # A name in neither index: the CLI still builds lm-eval's full TaskManager to be sure, over
    # an empty default folder here (its thousands of YAMLs cost ~15 CPU-s and hold no such name).
    defaults, build = Path(manager.__file__).parent, manager.TaskIndex.build
    monkeypatch.setattr(manager.TaskIndex, "build", staticmethod(lambda paths, **kw: build(
        [p for p in paths if Path(p) != defaults], **kw)))
    run = write_run(tmp_path, complete_steps=(1,), incomplete_steps=())[0]
    assert main(["--checkpoint", str(run), "--tasks", "no_such_task", "--device", "cpu"]) == 2
    assert_names(capsys.readouterr().err, "--tasks", "no_such_task")  # the option, the value
    assert main(["--checkpoint", str(run), "--tasks", "arc_easy_local", "--no-such-option"]) == 2
    assert "--no-such-option" in capsys.readouterr().err


# --- (f) without lm-eval -----------------------------------------------------------------------

def test_missing_lm_eval_is_one_clear_line(tmp_path):
    code = ("import sys; sys.modules['lm_eval'] = None\n"  # `import lm_eval` raises ImportError
            "from torchllm.eval.harness.cli import main\n"
            f"sys.exit(main(['--checkpoint', {str(tmp_path)!r}, '--tasks', 'arc_easy_local']))")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install -e ".[harness]"' in lines[0], proc.stderr
    assert proc.stdout == ""


# --- (f) every family, batched == one request at a time ----------------------------------------

@pytest.mark.parametrize("family", ["llama3", "gpt2", "qwen3", "qwen3_moe"])
def test_every_family_scores_batched_requests_as_one_at_a_time(family, tokenizer):
    """Right-padded batches score each request as its own unpadded forward does, for every
    registered family (MoE routing included) and two tokenizer kinds (bytes, SentencePiece)."""
    import dataclasses

    from conftest import build_model

    from torchllm.data.tokenizer import load_tokenizer
    from torchllm.models.registry import get

    spec = get(family)
    _, requests = task_requests("arc_easy_local", 2)
    rolling = rolling_requests(1)
    for tok in (tokenizer, load_tokenizer("bytes")):
        args = dataclasses.replace(spec.flavors["debug"], vocab_size=tok.vocab_size,
                                   max_seq_len=128)  # most pairs fit: batches are padded
        model = build_model(spec.model_cls, args, seed=1).eval()
        batched = TorchllmLM(model, tok, CPU, batch_size=8)
        single = TorchllmLM(model, tok, CPU, batch_size=1)
        lengths = {sum(map(len, batched._encode_pair(*r.args))) for r in requests}
        assert len([n for n in lengths if n <= 129]) > 1, lengths
        for a, b in zip(batched.loglikelihood(requests), single.loglikelihood(requests)):
            assert a[0] == pytest.approx(b[0], abs=1e-4) and a[1] == b[1], (family, a, b)
        for a, b in zip(batched.loglikelihood_rolling(rolling),
                        single.loglikelihood_rolling(rolling)):
            assert a == pytest.approx(b, abs=1e-4), (family, a, b)
