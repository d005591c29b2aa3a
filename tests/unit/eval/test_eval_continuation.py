"""Scored (context, continuation) pairs are the ids the model sees: for every tokenizer kind, the
ids equal tokenizer.encode(context + continuation) on real rows of every local task and of
HellaSwag (issue 33; encoding the continuation apart adds SentencePiece's dummy-prefix piece)."""

from __future__ import annotations

import json

import pytest
import torch

from torchllm.data.sources.embedded import embedded_documents
from torchllm.data.tokenizer import load_tokenizer
from torchllm.data.tokenizer_training import train_sentencepiece
from torchllm.eval import downstream, hellaswag
from torchllm.eval.continuation import encode_continuation
from torchllm.eval.tasks import LOCAL_NAME, TASKS, load_items

from conftest import shared_path

ROWS = 25  # per task and tokenizer
BIG = 1 << 20  # no truncation


def metaspace_tokenizer_json(folder):
    """A SentencePiece-style tokenizer.json (Metaspace: '▁' marks spaces, one dummy prefix at
    the start of a string), trained by `tokenizers` on the embedded documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(embedded_documents(), trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                              "eos_token": "</s>"}))
    return folder


@pytest.fixture(scope="module", params=["sp_auto", "mistral_sp", "gpt2", "llama3",
                                        "tokenizer_json"])
def tok(request, tmp_path_factory):
    kind = request.param
    if kind == "sp_auto":  # what data.tokenizer = 'auto' trains
        out = tmp_path_factory.mktemp("sp") / "tokenizer.model"
        return load_tokenizer(train_sentencepiece(embedded_documents(), 512, out))
    if kind == "tokenizer_json":
        return load_tokenizer(metaspace_tokenizer_json(tmp_path_factory.mktemp("json")))
    file = {"mistral_sp": ("mistral-sp32k", "tokenizer.model"), "gpt2": ("gpt2", "gpt2.tiktoken"),
            "llama3": ("llama3", "tokenizer.model")}[kind]
    return load_tokenizer(shared_path("tokenizers", *file))


def check_pair(tok, context: str, continuation: str, pair) -> bool:
    """The pair's ids are the whole string's; returns whether encoding apart would differ."""
    ctx_ids, cont_ids = pair
    assert ctx_ids + cont_ids == tok.encode(context + continuation, bos=True), \
        (context[-40:], continuation)
    assert cont_ids and ctx_ids[0] == tok.bos_id
    return ctx_ids + cont_ids != tok.encode(context, bos=True) + tok.encode(continuation)


def test_task_options_are_encoded_as_the_whole_string(tok):
    """Every local task (mc, schema, lm), zero-shot and 2-shot (the prompt's solved examples
    are part of the context string): option ids == encode(context + continuation)."""
    evals = shared_path("data", "evals")
    apart_differs = 0
    names = [n for n in TASKS if (evals / LOCAL_NAME.get(n, n)).is_dir()]
    assert len(names) >= 11 and {"mc", "schema", "lm"} <= {TASKS[n].kind for n in names}
    for name in names:
        items = load_items(name, str(evals))
        for i in range(min(ROWS, len(items))):
            for shots in (0, 2):
                item = downstream.with_shots(items, i, shots, seed=0)
                rows = downstream.encode_options(tok, item, BIG)
                assert len(rows) == item.num_options
                for j, pair in enumerate(rows):
                    apart_differs += check_pair(tok, *item.option(j), pair)
    if getattr(tok, "sp", None) is not None:  # SentencePiece: encoding apart is wrong here
        assert apart_differs > 0


def test_hellaswag_endings_are_encoded_as_the_whole_string(tok):
    examples = hellaswag.load_examples(str(shared_path("data", "hellaswag_val.jsonl")), ROWS)
    apart_differs = 0
    for ex in examples:
        for ending, pair in zip(ex["endings"], hellaswag.render_example(tok, ex, BIG)):
            apart_differs += check_pair(tok, ex["ctx"], " " + ending, pair)
    if getattr(tok, "sp", None) is not None:
        assert apart_differs == 4 * ROWS  # every ending gained a '▁' piece when encoded apart


def test_trailing_whitespace_and_truncation(tok):
    """A context's trailing space moves to the continuation (lm-eval's rule); past max_len the
    continuation stays whole and the oldest context tokens go."""
    context, continuation = "The capital of France is ", "Paris, on the river Seine."
    ctx_ids, cont_ids = encode_continuation(tok, context, continuation)
    assert ctx_ids == tok.encode(context.rstrip(), bos=True)
    assert ctx_ids + cont_ids == tok.encode(context + continuation, bos=True)
    whole = ctx_ids + cont_ids
    for max_len in (len(whole), len(cont_ids) + 2, len(cont_ids) + 1):
        c, x = encode_continuation(tok, context, continuation, max_len)
        assert (x, c) == (cont_ids, whole[len(whole) - max_len : len(ctx_ids)])
    c, x = encode_continuation(tok, context, continuation, 3)  # the continuation alone too long
    assert x == cont_ids[:2] and c == ctx_ids[-1:]


# --- The scores against an independent scorer: transformers on the HF export -------------------

HF_ROWS = 100
HF_BATCH = 32  # rows per transformers forward


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
    """A short debug-model run (auto SentencePiece tokenizer), exported; both sides in eval.
    Two blocks of 128 (GQA kept: 8 heads, 4 kv): scoring the ~1,300 rows below on each side is
    a quarter of the debug model's 80 CPU-s, and it learns as much in 20 steps (mean option
    loss 4.98 vs 4.91; the closest two options of a row 1.6e-4 apart, vs 5.7e-6)."""
    transformers = pytest.importorskip("transformers")
    from torchllm.hf.cli import main as hf_cli
    from torchllm.train import Trainer

    from conftest import tiny_config

    tmp = tmp_path_factory.mktemp("hf_scorer")
    trainer = Trainer(tiny_config(
        tmp, "--checkpoint.enable", "--job.run_name=run", "--training.steps=20",
        "--training.seq_len=64", "--model.max_seq_len=1024", "--optimizer.lr=3e-3",
        "--model.dim=128", "--model.n_layers=2"))
    trainer.train()
    assert hf_cli(["export", "--checkpoint", str(tmp / "run"), "--out", str(tmp / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf", dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp / "hf")
    return trainer.model.eval(), trainer.tokenizer, hf.eval(), hf_tok


def hf_losses(hf, hf_tok, pairs: list[tuple[str, str]]) -> tuple[list[float], list[float]]:
    """(summed, mean) NLL of each continuation, written independently of torchllm: the exported
    tokenizer encodes context + continuation whole (BOS added by it), the context's tokens are
    its own encoding (its trailing whitespace moved to the continuation, lm-eval's rule), and
    transformers runs the exported model on the right-padded batch."""
    seqs, starts = [], []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = hf_tok(context + continuation).input_ids, hf_tok(context).input_ids
        assert whole[: len(ctx)] == ctx and len(whole) > len(ctx)
        seqs.append(whole)
        starts.append(len(ctx))
    sums, means = [], []
    for first in range(0, len(seqs), HF_BATCH):
        batch = seqs[first : first + HF_BATCH]
        ids = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(batch):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        with torch.no_grad():
            logp = hf(input_ids=ids, attention_mask=mask).logits.double().log_softmax(-1)
        for i, (s, k) in enumerate(zip(batch, starts[first : first + HF_BATCH])):
            nll = -logp[i, torch.arange(k - 1, len(s) - 1), torch.tensor(s[k:])]
            sums.append(nll.sum().item())
            means.append(nll.mean().item())
    return sums, means


def per_row(values: list[float], counts: list[int]) -> list[list[float]]:
    out, start = [], 0
    for n in counts:
        out.append(values[start : start + n])
        start += n
    return out


def argmin(xs: list[float]) -> int:
    return min(range(len(xs)), key=xs.__getitem__)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["arc_easy", "piqa", "winogrande"])
def test_task_losses_equal_a_transformers_scorer(trained_export, name):
    model, tok, hf, hf_tok = trained_export
    items = load_items(name, str(shared_path("data", "evals")))[:HF_ROWS]
    result = downstream.evaluate_task(model, tok, name, items, 0, torch.device("cpu"),
                                      batch_size=16)
    assert len(result.predictions) == HF_ROWS
    _, flat = hf_losses(hf, hf_tok, [it.option(j) for it in items for j in range(it.num_options)])
    rows = per_row(flat, [it.num_options for it in items])
    for i, (p, means) in enumerate(zip(result.predictions, rows)):
        assert max(abs(a - b) for a, b in zip(p["mean_loss"], means)) < 1e-4, f"{name} row {i}"
        assert p["pred"] == argmin(means), f"{name} row {i}"


@pytest.mark.slow
def test_hellaswag_losses_equal_a_transformers_scorer(trained_export):
    model, tok, hf, hf_tok = trained_export
    examples = hellaswag.load_examples(str(shared_path("data", "hellaswag_val.jsonl")), HF_ROWS)
    result = hellaswag.evaluate(model, tok, examples, torch.device("cpu"), batch_size=8)
    assert result.n == HF_ROWS
    flat_sums, flat_means = hf_losses(hf, hf_tok, [(ex["ctx"], " " + e) for ex in examples
                                                   for e in ex["endings"]])
    rows = zip(per_row(flat_sums, [4] * HF_ROWS), per_row(flat_means, [4] * HF_ROWS))
    for i, (p, (sums, means)) in enumerate(zip(result.predictions, rows)):
        assert max(abs(a - b) for a, b in zip(p["mean_loss"], means)) < 1e-4, f"row {i}"
        assert max(abs(a - b) for a, b in zip(p["sum_loss"], sums)) < 1e-3, f"row {i}"
        assert (p["pred"], p["pred_norm"]) == (argmin(sums), argmin(means)), f"row {i}"
