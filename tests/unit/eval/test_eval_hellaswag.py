"""HellaSwag: batched scoring against a brute-force reference, loading, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from torchllm.data.tokenizer import SentencePieceTokenizer
from torchllm.data.tokenizer_training import train_sentencepiece
from torchllm.data.sources.embedded import embedded_documents
from torchllm.eval import hellaswag
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import Transformer

from conftest import build_model, shared_path
from messages import assert_names, raises_naming
from builders.eval import TINY_EXAMPLES, tiny_model, tokenizer, whole_string_ids, write_tiny_jsonl  # noqa: F401


def brute_force(model, tokenizer, example):
    """Independent reference: each ending in its own unpadded forward pass, float64 log-probs."""
    sums, means = [], []
    for ending in example["endings"]:
        ctx, end = whole_string_ids(tokenizer, example["ctx"], " " + ending)
        tokens = torch.tensor([ctx + end])
        with torch.no_grad():
            logp = F.log_softmax(model(tokens)[0].double(), dim=-1)
        nll = [-logp[len(ctx) + j - 1, t].item() for j, t in enumerate(end)]
        sums.append(sum(nll))
        means.append(sum(nll) / len(nll))
    argmin = lambda xs: sorted(range(4), key=lambda i: (xs[i], i))[0]  # noqa: E731
    return argmin(sums), argmin(means), sums, means


def check_against_reference(model, tokenizer, examples, batch_size):
    result = hellaswag.evaluate(model, tokenizer, examples, torch.device("cpu"), batch_size)
    assert result.n == len(examples) and len(result.predictions) == len(examples)
    correct = correct_norm = 0
    for i, (ex, p) in enumerate(zip(examples, result.predictions)):
        pred, pred_norm, sums, means = brute_force(model, tokenizer, ex)
        assert (p["index"], p["label"]) == (i, ex["label"])
        assert (p["pred"], p["pred_norm"]) == (pred, pred_norm), f"example {i}"
        assert p["sum_loss"] == pytest.approx(sums, rel=1e-4)
        assert p["mean_loss"] == pytest.approx(means, rel=1e-4)
        correct += pred == ex["label"]
        correct_norm += pred_norm == ex["label"]
    assert result.acc == correct / len(examples)
    assert result.acc_norm == correct_norm / len(examples)
    return result


def test_scoring_matches_brute_force_on_a_tiny_file(tmp_path, tokenizer):
    examples = hellaswag.load_examples(str(write_tiny_jsonl(tmp_path / "tiny.jsonl")))
    result = check_against_reference(tiny_model(), tokenizer, examples, batch_size=2)
    # Sum and mean disagree somewhere here (short vs long endings), so both paths are exercised.
    assert any(p["pred"] != p["pred_norm"] for p in result.predictions)


def test_scoring_matches_brute_force_on_real_hellaswag(tokenizer):
    path = shared_path("data", "hellaswag_val.jsonl")
    everything = hellaswag.load_examples(str(path))
    assert len(everything) == 10042  # the whole official validation split reads cleanly
    examples = everything[:12]
    assert examples[0]["ind"] == 24 and examples == hellaswag.load_examples(str(path), limit=12)
    check_against_reference(tiny_model(max_seq_len=384, seed=1), tokenizer, examples, batch_size=3)


def test_render_truncates_the_context_from_the_left(tokenizer):
    ex = TINY_EXAMPLES[4]
    rows = hellaswag.render_example(tokenizer, ex, max_len=12)
    for (ctx, end), ending in zip(rows, ex["endings"]):
        full_ctx, full_end = whole_string_ids(tokenizer, ex["ctx"], " " + ending)
        assert len(ctx) + len(end) <= 12
        assert end == full_end[:11]  # the ending stays whole (up to max_len - 1 tokens)
        assert ctx == full_ctx[len(full_ctx) - len(ctx):]  # the newest context tokens stay
    sums, means = hellaswag.score_rows(tiny_model(max_seq_len=12), rows, torch.device("cpu"))
    assert torch.isfinite(sums).all() and (means <= sums + 1e-6).all()


def test_bad_files_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [TINY_EXAMPLES[0], {"ctx": "x", "label": 0}]
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing endings"):
        hellaswag.load_examples(str(bad))
    bad.write_text(json.dumps({**TINY_EXAMPLES[0], "label": 7}) + "\n")
    with raises_naming(ValueError, "bad.jsonl", "'label' = 7", "0-3"):  # file, value, allowed
        hellaswag.load_examples(str(bad))
    with raises_naming(FileNotFoundError, tmp_path / "missing.jsonl"):
        hellaswag.load_examples(str(tmp_path / "missing.jsonl"))
    assert len(hellaswag.load_examples(str(write_tiny_jsonl(tmp_path / "t.jsonl")), limit=2)) == 2


def test_hub_code_path_reads_a_local_dataset_folder(tmp_path, monkeypatch):
    """The Hub branch goes through `datasets`; a local folder exercises it offline. The Hub copy
    stores labels as strings, as here."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "hellaswag"
    folder.mkdir()
    write_tiny_jsonl(folder / "validation.jsonl",
                     [{**ex, "label": str(ex["label"])} for ex in TINY_EXAMPLES])
    hub = hellaswag.load_examples(str(folder), limit=4)
    local = hellaswag.load_examples(str(write_tiny_jsonl(tmp_path / "t.jsonl")), limit=4)
    assert [(e["ctx"], e["endings"], e["label"]) for e in hub] == [
        (e["ctx"], e["endings"], e["label"]) for e in local]


def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    from builders.eval import write_run

    run_dir, _ = write_run(tmp_path, complete_steps=(1,), incomplete_steps=())
    data = write_tiny_jsonl(tmp_path / "tiny.jsonl")
    out = tmp_path / "result" / "hs.json"
    assert hellaswag.main(["--checkpoint", str(run_dir), "--data", str(data), "--limit", "4",
                           "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert_names(printed, "acc_norm", "0.25")  # the metric, and chance for 4 endings
    result = json.loads(out.read_text())
    assert result["n"] == 4 and len(result["predictions"]) == 4
    preds = result["predictions"]
    assert result["acc"] == sum(p["pred"] == p["label"] for p in preds) / 4
    assert result["acc_norm"] == sum(p["pred_norm"] == p["label"] for p in preds) / 4
    assert [p["ind"] for p in preds] == [0, 1, 2, 3]
    assert hellaswag.main(["--checkpoint", str(run_dir), "--data", str(tmp_path / "no.jsonl")]) == 2


def test_cli_applies_config_overrides(tmp_path, capsys):
    from builders.eval import write_run

    run_dir, _ = write_run(tmp_path, complete_steps=(1,), incomplete_steps=())
    data = write_tiny_jsonl(tmp_path / "tiny.jsonl")
    out = tmp_path / "hs.json"
    # eval.hellaswag_data from the command line, as for training: no --data needed.
    assert hellaswag.main(["--checkpoint", str(run_dir), f"--eval.hellaswag_data={data}",
                           "--eval.hellaswag_batch_size", "2", "--json", str(out)]) == 0
    assert f"data {data}" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["data"] == str(data) and result["n"] == len(TINY_EXAMPLES)
    assert [p["label"] for p in result["predictions"]] == [e["label"] for e in TINY_EXAMPLES]
    # --data still wins over the config; unknown keys and stray arguments are errors.
    assert hellaswag.main(["--checkpoint", str(run_dir), "--data", str(data), "--limit", "2",
                           "--eval.hellaswag_data=missing.jsonl", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n"] == 2
    assert hellaswag.main(["--checkpoint", str(run_dir), "--eval.no_such_key=1"]) == 2
    assert "unknown key eval.no_such_key" in capsys.readouterr().err
    assert hellaswag.main(["--checkpoint", str(run_dir), "--dat", str(data)]) == 2
    assert "unexpected argument '--dat'" in capsys.readouterr().err
