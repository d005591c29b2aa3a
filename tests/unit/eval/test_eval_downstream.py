"""CORE-style downstream evaluation: each scorer against a brute-force reference on real rows,
deterministic K-shot prompts, 2 ranks == 1, the CLI and the in-loop callback."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from torchllm.eval import downstream
from torchllm.eval.hellaswag import score_rows
from torchllm.eval.tasks import TASKS, Item, chance, load_items, parse_task

from conftest import shared_path, spawn_gloo, tiny_args
from builders.eval import tiny_model, tokenizer, whole_string_ids  # noqa: F401 (fixture)

CPU = torch.device("cpu")
MAX_LEN = 1024


def evals_dir():
    return str(shared_path("data", "evals"))


def short_rows(name: str, count: int, tok, max_tokens: int = 300) -> list[Item]:
    """The first `count` rows of a real task whose options fit the model without truncation."""
    items = [it for it in load_items(name, evals_dir())
             if all(len(tok.encode(c)) + len(tok.encode(x)) < max_tokens
                    for c in it.contexts for x in it.continuations)]
    return items[:count]


def nll_per_token(model, ctx: list[int], cont: list[int]) -> list[float]:
    """Independent reference: one unpadded forward, float64 log-probs of the continuation."""
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ctx + cont]))[0].double(), dim=-1)
    return [-logp[len(ctx) + j - 1, t].item() for j, t in enumerate(cont)]


def greedy_decode(model, ctx: list[int], n: int) -> list[int]:
    """Independent reference: n greedy tokens, one full forward per token (no cache, no batch)."""
    out = list(ctx)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ctx):]


def brute_force(model, tok, item: Item, kind: str) -> tuple[int, list[float]]:
    """(prediction, mean losses) as the task type defines them, option by option."""
    means = []
    for i in range(item.num_options):
        nll = nll_per_token(model, *whole_string_ids(tok, *item.option(i)))
        means.append(sum(nll) / len(nll))
    if kind == "lm":
        ctx, ids = whole_string_ids(tok, *item.option(0))
        hit = greedy_decode(model, ctx, len(ids)) == ids
        return (0 if hit else -1), means
    return min(range(len(means)), key=lambda i: (means[i], i)), means


@pytest.mark.parametrize("name,kind", [("arc_easy", "mc"), ("winogrande", "schema"),
                                       ("sciq_lm", "lm"), ("copa", "mc")])
def test_scorer_matches_brute_force_on_real_rows(tokenizer, name, kind):
    assert TASKS[name].kind == kind
    items = short_rows(name, 5, tokenizer)
    model = tiny_model(max_seq_len=MAX_LEN, seed=1)
    result = downstream.evaluate_task(model, tokenizer, name, items, 0, CPU, batch_size=2)
    assert result.n == len(items) == len(result.predictions) == 5
    correct = 0
    for i, (item, p) in enumerate(zip(items, result.predictions)):
        pred, means = brute_force(model, tokenizer, item, kind)
        assert (p["index"], p["gold"], p["pred"]) == (i, item.gold, pred), f"{name} row {i}"
        assert p["mean_loss"] == pytest.approx(means, rel=1e-4)
        correct += pred == item.gold
    assert result.acc == correct / 5
    assert result.centered == pytest.approx((result.acc - result.chance) / (1 - result.chance))


def test_greedy_match_against_brute_force_decoding(tokenizer):
    """The lm scorer's exact-match flag (one teacher-forced pass) equals greedy decoding's
    verdict, on continuations that do and do not match: real sciq contexts, each followed by the
    model's own greedy tokens (a match), and by those tokens with one changed (no match)."""
    model = tiny_model(max_seq_len=MAX_LEN, seed=2)
    rows, expected = [], []
    for item in short_rows("sciq_lm", 4, tokenizer):
        ctx = tokenizer.encode(item.contexts[0], bos=True)
        greedy = greedy_decode(model, ctx, 5)
        for j in range(len(greedy) + 1):  # j = len: unchanged; else token j altered
            cont = list(greedy)
            if j < len(cont):
                cont[j] = (cont[j] + 1) % 512
            rows.append((ctx, cont))
            expected.append(cont == greedy)  # greedy decoding reproduces it iff unchanged
    _, _, hits = score_rows(model, rows, CPU, greedy_match=True)
    assert hits.tolist() == expected and any(expected) and not all(expected)


def test_fewshot_prompts_are_deterministic_and_exclude_the_row():
    items = load_items("arc_easy", evals_dir())[:40]
    a = [downstream.with_shots(items, i, 3, seed=7) for i in range(10)]
    assert a == [downstream.with_shots(items, i, 3, seed=7) for i in range(10)]
    assert a != [downstream.with_shots(items, i, 3, seed=8) for i in range(10)]
    for i, prompt in enumerate(a):
        shots = downstream.fewshot_indices(len(items), i, 3, 7)
        assert len(set(shots)) == 3 and i not in shots and all(0 <= j < 40 for j in shots)
        solved = [items[j].contexts[0] + items[j].continuations[items[j].gold] for j in shots]
        sep = downstream.SHOT_SEPARATOR
        assert prompt.contexts == (sep.join(solved) + sep + items[i].contexts[0],)
        assert (prompt.continuations, prompt.gold) == (items[i].continuations, items[i].gold)
    for i in range(6):  # 5 shots of 6 rows: exactly the other rows
        assert sorted(downstream.fewshot_indices(6, i, 5, 1)) == [j for j in range(6) if j != i]
    # Schema tasks: the solved example is its right context + the shared continuation.
    wino = load_items("winogrande", evals_dir())[:20]
    p = downstream.with_shots(wino, 0, 1, seed=0)
    (j,) = downstream.fewshot_indices(20, 0, 1, 0)
    shot = wino[j].contexts[wino[j].gold] + wino[j].continuations[0]
    assert p.contexts == tuple(shot + "\n\n" + c for c in wino[0].contexts)
    with pytest.raises(ValueError, match="5-shot needs 6 rows; the task has 3"):
        downstream.fewshot_indices(3, 0, 5, 0)


def test_task_names_and_errors(tmp_path):
    assert parse_task("arc_easy", 2) == ("arc_easy", 2) and parse_task("copa:5", 0) == ("copa", 5)
    with pytest.raises(ValueError) as e:  # the name refused, and the tasks there are
        parse_task("arc", 0)
    assert "'arc'" in str(e.value) and all(name in str(e.value) for name in TASKS)
    with pytest.raises(ValueError) as e:  # the entry, and what the part after ':' must be
        parse_task("copa:x", 0)
    assert "'copa:x'" in str(e.value) and "integer" in str(e.value)
    (tmp_path / "copa.jsonl").write_text(json.dumps(
        {"premise": "It rained.", "choice1": "A.", "choice2": "B.", "question": "effect",
         "label": 1}) + "\n")
    assert load_items("copa", str(tmp_path)) == [
        Item(("It rained therefore",), (" a.", " b."), 1)]


def test_every_local_task_loads_with_its_row_count():
    counts = {"arc_easy": 570, "arc_challenge": 299, "piqa": 1838, "winogrande": 1267,
              "openbookqa": 500, "boolq": 3270, "copa": 100, "commonsense_qa": 1221,
              "social_iqa": 1954, "sciq": 1000, "sciq_lm": 1000}
    for name, n in counts.items():
        items = load_items(name, evals_dir())
        assert len(items) == n
        assert all(0 <= it.gold < it.num_options for it in items), name
    options = {"piqa": 2, "winogrande": 2, "boolq": 2, "copa": 2, "commonsense_qa": 5,
               "social_iqa": 3, "sciq": 4, "openbookqa": 4, "sciq_lm": 1}
    for name, k in options.items():
        items = load_items(name, evals_dir())
        assert {it.num_options for it in items} == {k}, name
        assert chance(TASKS[name].kind, items) == (0.0 if k == 1 else pytest.approx(1 / k))
    arc = load_items("arc_challenge", evals_dir())
    assert {it.num_options for it in arc} <= {3, 4, 5}
    assert chance("mc", arc) == pytest.approx(sum(1 / it.num_options for it in arc) / len(arc))


def _worker(rank, tmp, tok_path, tasks):
    from torchllm.data.tokenizer import SentencePieceTokenizer

    torch.set_num_threads(1)
    result = downstream.evaluate(tiny_model(max_seq_len=MAX_LEN),
                                 SentencePieceTokenizer(tok_path), tasks, CPU, limit=5,
                                 seed=3, batch_size=2)
    torch.save(result.to_json(), f"{tmp}/rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, tokenizer):
    tasks = {name: (short_rows(name, 12, tokenizer, 200), shots)
             for name, shots in (("arc_easy", 1), ("winogrande", 2), ("sciq_lm", 0))}
    # 5 rows, 2 per batch: rank 1 gets 2 rows and runs one discarded dummy batch.
    spawn_gloo(_worker, tmp_path, str(tokenizer.path), tasks)
    single = downstream.evaluate(tiny_model(max_seq_len=MAX_LEN), tokenizer, tasks, CPU,
                                 limit=5, seed=3, batch_size=2).to_json()
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert out["core"] == single["core"]
        for name, t in single["tasks"].items():
            o = out["tasks"][name]
            assert (o["n"], o["acc"], o["shots"]) == (t["n"], t["acc"], t["shots"])
            assert t["n"] == 5
            assert [p["pred"] for p in o["predictions"]] == [p["pred"] for p in t["predictions"]]
            for p, q in zip(o["predictions"], t["predictions"]):
                assert p["mean_loss"] == pytest.approx(q["mean_loss"], rel=1e-5)


def test_cli_prints_table_and_writes_json(tiny_run, tmp_path, capsys):
    run_dir = tiny_run
    out = tmp_path / "core.json"
    assert downstream.main(["--checkpoint", str(run_dir), "--tasks", "copa:1,winogrande",
                            "--data-dir", evals_dir(), "--limit", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CORE (mean centered accuracy over 2 tasks)" in printed
    result = json.loads(out.read_text())
    assert set(result["tasks"]) == {"copa", "winogrande"}
    centered = []
    for t in result["tasks"].values():
        preds = t["predictions"]
        assert t["n"] == len(preds) == 4 and t["chance"] == 0.5
        assert t["acc"] == sum(p["pred"] == p["gold"] for p in preds) / 4
        centered.append((t["acc"] - 0.5) / 0.5)
    assert result["tasks"]["copa"]["shots"] == 1
    assert result["core"] == pytest.approx(sum(centered) / 2)
    assert downstream.main(["--checkpoint", str(run_dir), "--tasks", "nope"]) == 2


def test_in_training_callback_logs_scalars(tmp_path, caplog):
    from torchllm.config import load_config
    from torchllm.train import Trainer

    cfg = load_config(tiny_args(tmp_path, "--eval.tasks=copa,sciq_lm", "--eval.tasks_freq=2",
                                "--eval.tasks_limit=3", f"--eval.tasks_data_dir={evals_dir()}",
                                "--training.seq_len=128"))
    trainer = Trainer(cfg)
    cb = trainer.callback(downstream.DownstreamEval)
    assert cb is not None
    assert cb.on_step_end(trainer.context, 1, {}) is None
    with caplog.at_level("INFO"):
        report = cb.on_step_end(trainer.context, 2, {})
    assert set(report.scalars) == {"downstream/core", "downstream/copa/acc",
                                   "downstream/copa/centered", "downstream/sciq_lm/acc",
                                   "downstream/sciq_lm/centered"}
    assert "downstream step 2: CORE" in caplog.text
    s = report.scalars
    assert s["downstream/core"] == pytest.approx(
        (s["downstream/copa/centered"] + s["downstream/sciq_lm/centered"]) / 2)
    with pytest.raises(Exception) as e:  # the key and the value
        Trainer(load_config(tiny_args(tmp_path, "--eval.tasks=nope", "--eval.tasks_freq=2")))
    assert "eval.tasks" in str(e.value) and "'nope'" in str(e.value)


# --- The CLI offline: default tasks, HellaSwag's local file, config overrides ---------------------

# The 11 tasks with a copy in ../shared/data/evals (sciq_lm reads sciq's) and HellaSwag.
EXPECTED_DEFAULT = {"arc_easy", "arc_challenge", "piqa", "winogrande", "openbookqa", "boolq",
                    "copa", "commonsense_qa", "social_iqa", "sciq", "sciq_lm", "hellaswag"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from builders.eval import write_run

    return write_run(tmp_path_factory.mktemp("downstream_cli"), complete_steps=(1,),
                     incomplete_steps=())[0]


def table_rows(printed: str) -> dict[str, list[str]]:
    """{task: its row's fields} of the table the CLI prints (between the header and CORE)."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("task "))
    end = next(i for i, line in enumerate(lines) if line.startswith("CORE "))
    return {line.split()[0]: line.split() for line in lines[start + 1 : end]}


def hellaswag_slice(path, n: int) -> list[dict]:
    """The first n rows of the official HellaSwag file, written to `path`."""
    with open(shared_path("data", "hellaswag_val.jsonl"), encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    path.write_text("".join(lines))
    return [json.loads(line) for line in lines]


def local_copies(folder):
    """A --data-dir as a user builds one: links to the shared task copies."""
    folder.mkdir()
    for task in sorted(shared_path("data", "evals").iterdir()):
        (folder / task.name).symlink_to(task)
    return folder


@pytest.mark.slow
def test_cli_runs_the_default_tasks_offline_with_a_local_hellaswag_file(tiny_run, tmp_path):
    from cli import run_module

    data_dir = local_copies(tmp_path / "evals")
    rows = hellaswag_slice(data_dir / "hellaswag.jsonl", 7)
    out = tmp_path / "core.json"
    # A process: HF_*_OFFLINE are read when datasets / huggingface_hub are imported, so an
    # offline run must start clean (this process may have imported them online).
    proc = run_module("torchllm.eval.downstream", "--checkpoint", str(tiny_run), "--data-dir",
                      str(data_dir), "--limit", "5", "--json", str(out), process=True,
                      env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                           "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(table_rows(proc.stdout)) == EXPECTED_DEFAULT, proc.stdout
    assert f"over {len(EXPECTED_DEFAULT)} tasks" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["tasks"]) == EXPECTED_DEFAULT
    assert all(t["n"] == 5 for t in result["tasks"].values())
    hs = result["tasks"]["hellaswag"]["predictions"]  # scored from the slice, row by row
    assert [p["gold"] for p in hs] == [r["label"] for r in rows[:5]]
    assert all(len(p["mean_loss"]) == 4 for p in hs)


def test_hellaswag_task_reads_the_data_dir_file_before_eval_hellaswag_data(tmp_path):
    rows = hellaswag_slice(tmp_path / "hellaswag.jsonl", 6)
    items = load_items("hellaswag", str(tmp_path), str(tmp_path / "elsewhere.jsonl"))
    assert items == [Item((r["ctx"],), tuple(" " + e for e in r["endings"]), r["label"])
                     for r in rows]
    (tmp_path / "hellaswag.jsonl").unlink()
    official = tmp_path / "official" / "hellaswag_val.jsonl"  # the file eval.hellaswag_data names
    official.parent.mkdir()
    hellaswag_slice(official, 3)
    assert load_items("hellaswag", str(tmp_path), str(official)) == items[:3]


def test_missing_hellaswag_file_names_the_paths_looked_at(tmp_path):
    missing = tmp_path / "no" / "hellaswag_val.jsonl"
    with pytest.raises(ValueError) as err:
        load_items("hellaswag", str(tmp_path), str(missing))
    msg = str(err.value)
    for text in (f"{tmp_path / 'hellaswag'}/", str(tmp_path / "hellaswag.jsonl"), str(missing),
                 "--eval.hellaswag_data="):
        assert text in msg, msg
    with pytest.raises(ValueError, match="eval.tasks_data_dir / --data-dir is empty"):
        load_items("hellaswag", "", str(missing))


def test_cli_applies_config_overrides(tiny_run, capsys):
    argv = ["--checkpoint", str(tiny_run), "--tasks", "copa,winogrande", "--data-dir",
            evals_dir()]
    assert downstream.main([*argv, "--eval.tasks_limit=3", "--eval.tasks_fewshot", "2"]) == 0
    printed = capsys.readouterr().out
    rows = table_rows(printed)
    assert set(rows) == {"copa", "winogrande"}
    assert all(r[2:4] == ["2", "3"] for r in rows.values()), printed  # shots, n
    # The flag still wins over the (overridden) config, as for the run's own values.
    assert downstream.main([*argv, "--eval.tasks_limit=3", "--limit", "2"]) == 0
    assert [r[3] for r in table_rows(capsys.readouterr().out).values()] == ["2", "2"]
    assert downstream.main([*argv, "--eval.no_such_key=1"]) == 2


def test_cli_data_is_not_an_abbreviation_of_data_dir(tiny_run, capsys):
    argv = ["--checkpoint", str(tiny_run), "--tasks", "copa", "--limit", "2"]
    assert downstream.main([*argv, "--data", evals_dir()]) == 2  # main's: it meant --data-dir
    err = capsys.readouterr().err  # main() logs to stderr
    assert "--data is not an option" in err
    assert "--data-dir DIR" in err and "--eval.hellaswag_data=FILE" in err
    assert downstream.main([*argv, "--data-d", evals_dir()]) == 2  # no prefix matching
    assert "unexpected argument '--data-d'" in capsys.readouterr().err
