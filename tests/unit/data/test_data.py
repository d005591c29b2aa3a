"""The data pipeline: packing, epochs, rank split, exact resume, sources, shards, bad input."""

import json
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from torchllm.config import ConfigError
from torchllm.data import build_data, build_tokenizer
from torchllm.data.prepare import main as prepare_cli
from torchllm.data.sources.shards import HEADER_BYTES, open_split, token_dtype

from conftest import REPO, shared_path, tiny_config
from messages import assert_names, raises_naming
from builders.data import data_args, ByteTokenizer, TOK, assert_batches_equal, corpus_texts, make_hf_folder, resumed_equals_straight, take, write_jsonl  # noqa: F401


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "corpus.jsonl", corpus_texts())


def cfg_for(tmp_path, dataset, *extra, seq=16, batch=2):
    return tiny_config(tmp_path, f"--data.dataset={dataset}", f"--training.seq_len={seq}",
                       f"--training.local_batch_size={batch}", *extra)


def test_packing_conserves_tokens_and_positions(tmp_path, jsonl):
    cfg = cfg_for(tmp_path, f"local:{jsonl}", "--data.val_fraction=0",
                  "--data.shuffle_windows=false", batch=1)
    train, _ = build_data(*data_args(cfg), TOK, 0, 1)
    ds = train.dataset
    windows = [ds.batch(n) for n in range(ds.batches_per_epoch)]
    stream = torch.cat([torch.cat([w["inputs"][0], w["targets"][0, -1:]]) for w in windows])
    docs = [TOK.encode(t, bos=True, eos=True) for t in corpus_texts()]
    expected = torch.tensor([i for d in docs for i in d])
    assert len(expected) - len(stream) < 17  # only the tail shorter than a window is unused
    assert torch.equal(stream, expected[: len(stream)])
    for w in windows:  # inputs and targets are one stream shifted by one token
        assert torch.equal(w["inputs"][0, 1:], w["targets"][0, :-1])
    positions = torch.tensor([p for d in docs for p in range(len(d))])
    inputs_only = torch.cat([w["positions"][0] for w in windows])
    per_window = positions[: len(stream)].view(len(windows), 17)[:, :-1].flatten()
    assert torch.equal(inputs_only, per_window)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("dp", [1, 2])
def test_resume_is_exact(tmp_path, jsonl, workers, dp):
    cfg = cfg_for(tmp_path, f"local:{jsonl}", f"--data.num_workers={workers}")
    for rank in range(dp):
        loader, _ = build_data(*data_args(cfg), TOK, rank, dp)
        it = iter(loader)
        # Run past an epoch boundary before and after the checkpoint.
        n_epoch = loader.dataset.batches_per_epoch
        for _ in range(n_epoch - 2):
            next(it)
        state = loader.state_dict()
        after = [next(it) for _ in range(5)]
        resumed, _ = build_data(*data_args(cfg), TOK, rank, dp)
        resumed.load_state_dict(state)
        assert_batches_equal(take(resumed, 5), after)
        assert state["dp_degree"] == dp


def test_train_stops_its_loader_workers(tmp_path):
    """After train() no loader worker is left: a Trainer's worker iterator left to the garbage
    collector (finalized after its queues) joined each worker until a 5 s timeout, in every
    process that builds Trainers."""
    from torchllm.train import Trainer

    before = set(multiprocessing.active_children())
    trainer = Trainer(tiny_config(tmp_path, "--training.steps=2", "--data.num_workers=2"))
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    trainer.train()
    assert not any(w.is_alive() for w in workers)


def test_resume_under_another_dp_degree_continues_the_global_order_or_is_refused(tmp_path,
                                                                                 jsonl):
    """1 rank x 4 sequences, 3 batches read; 2 ranks x 2 resume: each rank's next batch is its
    half of the batch the one rank reads next. A position that falls inside the new layout's
    batch (1 batch of 2 on 1 rank; 2 ranks x 2 read 4 at a time) is refused in one line."""
    one, _ = build_data(*data_args(cfg_for(tmp_path, f"local:{jsonl}", batch=4)), TOK, 0, 1)
    it = iter(one)
    for _ in range(3):
        next(it)
    state, want = one.state_dict(), next(it)
    halves = []
    for r in range(2):
        rank, _ = build_data(*data_args(cfg_for(tmp_path, f"local:{jsonl}", batch=2)), TOK, r, 2)
        rank.load_state_dict(state)
        halves.append(take(rank, 1)[0])
    # (the processed-token counts of the halves add up to the whole batch's)
    assert_batches_equal([{k: torch.cat([h[k] for h in halves]) if want[k].dim()
                           else sum(h[k] for h in halves) for k in want}], [want])
    small, _ = build_data(*data_args(cfg_for(tmp_path, f"local:{jsonl}", batch=2)), TOK, 0, 1)
    take(small, 1)
    other, _ = build_data(*data_args(cfg_for(tmp_path, f"local:{jsonl}", batch=2)), TOK, 0, 2)
    with raises_naming(ConfigError, "degree 1", "degree 2", "checkpoint.exclude_from_loading"):
        other.load_state_dict(small.state_dict())


def test_ranks_are_disjoint_cover_the_epoch_and_concatenate_to_one_rank(tmp_path, jsonl):
    cfg2 = cfg_for(tmp_path, f"local:{jsonl}", batch=2)
    cfg1 = cfg_for(tmp_path, f"local:{jsonl}", batch=4)
    ranks = [build_data(*data_args(cfg2), TOK, r, 2)[0].dataset for r in range(2)]
    single = build_data(*data_args(cfg1), TOK, 0, 1)[0].dataset
    n = single.batches_per_epoch
    assert ranks[0].batches_per_epoch == n
    seen = []
    for step in range(2 * n):  # two epochs: parity holds across the boundary
        parts = [ds.batch(step) for ds in ranks]
        joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}  # rank by rank
        assert_batches_equal([joined], [single.batch(step)])
        if step < n:
            seen += [tuple(row.tolist()) for p in parts for row in p["inputs"]]
    stream = single.stream
    all_windows = {tuple(stream.window(i, 17)[0][:-1].tolist()) for i in range(stream.num_windows(17))}
    assert len(set(seen)) == len(seen) == n * 4  # disjoint
    assert set(seen) <= all_windows and len(all_windows) - len(seen) < 4  # covers the epoch


def test_epoch_order_differs_per_epoch_and_is_reproducible(tmp_path, jsonl):
    cfg = cfg_for(tmp_path, f"local:{jsonl}")
    a, b = (build_data(*data_args(cfg), TOK, 0, 1)[0].dataset for _ in range(2))
    other = build_data(*data_args(cfg_for(tmp_path, f"local:{jsonl}", "--job.seed=7")), TOK, 0, 1)[0].dataset
    e0, e1 = a.epoch_order(0), a.epoch_order(1)
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(len(e0)))
    assert not np.array_equal(e0, e1)
    assert np.array_equal(e1, b.epoch_order(1))
    assert not np.array_equal(e0, other.epoch_order(0))
    n = a.batches_per_epoch
    assert not torch.equal(a.batch(0)["inputs"], a.batch(n)["inputs"])


def test_validation_loader_is_fixed_the_same_on_every_rank_and_held_out(tmp_path, jsonl):
    cfg = cfg_for(tmp_path, f"local:{jsonl}", "--data.val_fraction=0.2", "--validation.enable")
    train, val = build_data(*data_args(cfg), TOK, 0, 1)
    first, again = list(val), list(val)
    assert len(first) > 1
    assert_batches_equal(first, again)
    val_rows = {tuple(r.tolist()) for b in first for r in b["inputs"]}
    ds = train.dataset
    train_rows = {tuple(r.tolist()) for n in range(ds.batches_per_epoch) for r in ds.batch(n)["inputs"]}
    assert not val_rows & train_rows
    # Every rank holds the whole split; evaluation shares it out
    # (tests/unit/eval/test_eval_validation).
    assert_batches_equal(list(build_data(*data_args(cfg), TOK, 1, 2)[1]), first)


def test_local_jsonl_parquet_txt_read_through_datasets_offline(tmp_path):
    """Run in a fresh interpreter: datasets reads HF_DATASETS_OFFLINE at import."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus_texts(30)
    write_jsonl(tmp_path / "a.jsonl", texts[:15], column="body")
    write_jsonl(tmp_path / "b.jsonl", texts[15:], column="body")
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"content": texts}), tmp_path / "pq" / "x.parquet")
    (tmp_path / "t.txt").write_text("line one\n\nline two\n")
    script = (
        "import json, sys\n"
        "from torchllm.config.sections import Data\n"
        "from torchllm.data.dataset import documents\n"
        f"d = '{tmp_path}'\n"
        "out = [list(documents(Data(dataset='local:' + d + '/*.jsonl', text_column='body'))),\n"
        "       list(documents(Data(dataset='local:' + d + '/pq', text_column='content'))),\n"
        "       list(documents(Data(dataset='local:' + d + '/t.txt')))]\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    jsonl_docs, parquet_docs, txt_docs = json.loads(proc.stdout.splitlines()[-1])
    assert jsonl_docs == texts and parquet_docs == texts
    assert txt_docs == ["line one\n\nline two\n"]  # a .txt file is one document


@pytest.mark.parametrize("workers", [0, 2])
def test_hf_streaming_resume_and_validation_holdout(tmp_path, workers):
    """The Hub code path (load_dataset streaming + split_dataset_by_node) on a local folder."""
    folder, texts = make_hf_folder(tmp_path)
    cfg = cfg_for(tmp_path, f"hf:{folder}", "--data.val_documents=10", "--validation.enable",
                  f"--data.num_workers={workers}")
    def text(batches):  # whole windows: inputs plus the last target
        return "".join(TOK.decode(torch.cat([b["inputs"], b["targets"][:, -1:]], 1).flatten().tolist())
                       for b in batches)

    train_text = val_text = ""
    for rank in range(2):
        loader, val = build_data(*data_args(cfg), TOK, rank, 2)
        it = iter(loader)
        before = [next(it) for _ in range(4)]
        state = loader.state_dict()
        after = [next(it) for _ in range(40)]  # past the end of this rank's stream: epoch 2
        resumed, _ = build_data(*data_args(cfg), TOK, rank, 2)
        resumed.load_state_dict(state)
        assert_batches_equal(take(resumed, 40), after)
        train_text += text(before + after)
        val_text += text(val)
    assert "doc0003 " in val_text and "doc0003 " not in train_text
    assert "doc0016 " in train_text and "doc0016 " not in val_text
    assert train_text.count("doc0016 ") >= 2  # a second epoch began


@pytest.mark.slow
def test_prepare_shards_loader_end_to_end_on_tiny_shakespeare(tmp_path):
    text_file = shared_path("data", "tinyshakespeare.txt")
    sp = shared_path("tokenizers", "mistral-sp32k", "tokenizer.model")
    out = tmp_path / "shards"
    assert prepare_cli(["--dataset", f"local:{text_file}", "--tokenizer", str(sp), "--out",
                        str(out), "--shard-tokens", "60_000", "--val-tokens", "20000",
                        "--workers", "2"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["vocab_size"] == 32000
    train, val = open_split(out, "train"), open_split(out, "val")
    assert len(val) == 20000 and len(index["splits"]["train"]["shards"]) > 3
    import sentencepiece as spm

    oracle = [1] + spm.SentencePieceProcessor(model_file=str(sp)).encode(text_file.read_text()) + [2]
    assert np.concatenate([val.read(0, len(val)), train.read(0, len(train))]).tolist() == oracle

    cfg = cfg_for(tmp_path, f"shards:{out}", "--data.num_workers=2", seq=64, batch=4)
    tok = build_tokenizer(cfg.data, tmp_path / "unused")  # auto = the shards' own tokenizer
    assert tok.vocab_size == 32000
    loader, val_loader = build_data(*data_args(cfg), tok, 0, 1)
    ds = loader.dataset
    assert len(ds.chunks) - 1 == len(index["splits"]["train"]["shards"])
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    state = loader.state_dict()
    after = [next(it) for _ in range(3)]
    resumed, _ = build_data(*data_args(cfg), tok, 0, 1)
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 3), after)
    assert "Citizen" in tok.decode(next(iter(val_loader))["inputs"][0].tolist())
    assert batches[0]["inputs"].shape == (4, 64)


def test_large_vocab_shards_are_uint32(tmp_path):
    llama3 = shared_path("tokenizers", "llama3", "tokenizer.model")
    corpus = write_jsonl(tmp_path / "c.jsonl", corpus_texts(20))
    assert token_dtype(65536) == np.uint16 and token_dtype(128256) == np.uint32
    assert prepare_cli(["--dataset", f"local:{corpus}", "--tokenizer", str(llama3), "--out",
                        str(tmp_path / "s"), "--shard-tokens", "100", "--val-tokens", "50",
                        "--workers", "1"]) == 0
    val, train = open_split(tmp_path / "s", "val"), open_split(tmp_path / "s", "train")
    assert train.parts[0].dtype == "<u4" and len(train.parts) > 1
    tok = build_tokenizer(cfg_for(tmp_path, f"shards:{tmp_path / 's'}").data, tmp_path)
    expected = [i for t in corpus_texts(20) for i in tok.encode(t, bos=True, eos=True)]
    assert np.concatenate([val.read(0, len(val)), train.read(0, len(train))]).tolist() == expected


def test_bad_input_errors_name_the_problem(tmp_path, jsonl):
    def error(dataset, *extra, tok=TOK):
        with pytest.raises(ConfigError) as e:
            build_data(*data_args(cfg_for(tmp_path, dataset, *extra)), tok, 0, 1)
        return str(e.value)

    assert_names(error(f"local:{tmp_path}/missing.jsonl"), f"local:{tmp_path}/missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    assert "empty" in error(f"local:{tmp_path}/empty.jsonl")
    assert_names(error(f"local:{jsonl}", "--data.text_column=body"), "data.text_column", "'body'",
                 jsonl.name)
    assert_names(error("fineweb_edux"), "'fineweb_edux'", "local:")  # the value, the kinds known
    assert_names(error(f"local:{jsonl}", "--training.seq_len=20000"), "training.seq_len + 1 = 20001",
                 "local_batch_size")  # the window, and the batch it cannot fill
    assert_names(error(f"shards:{tmp_path}"), tmp_path / "index.json")

    out = tmp_path / "shards"
    assert prepare_cli(["--dataset", f"local:{jsonl}", "--tokenizer", str(tmp_path / "no.model"),
                        "--out", str(out)]) == 2


def test_shard_header_and_vocab_are_checked(tmp_path, jsonl):
    sp = shared_path("tokenizers", "mistral-sp32k", "tokenizer.model")
    out = tmp_path / "s"
    assert prepare_cli(["--dataset", f"local:{jsonl}", "--tokenizer", str(sp), "--out", str(out),
                        "--shard-tokens", "500", "--val-tokens", "100", "--workers", "1"]) == 0
    cfg = cfg_for(tmp_path, f"shards:{out}")
    with raises_naming(ConfigError, "index.json", "32000", "259", key="data.tokenizer"):
        build_data(*data_args(cfg), TOK, 0, 1)
    tok = build_tokenizer(cfg.data, tmp_path)
    shard = out / "train_000001.bin"
    raw = bytearray(shard.read_bytes())
    raw[:8] = b"garbage!"
    shard.write_bytes(bytes(raw))
    with raises_naming(ConfigError, shard, "TLLMSHRD", "header"):  # the file, the magic it lacks
        build_data(*data_args(cfg), tok, 0, 1)
    shard.write_bytes(b"TLLMSHRD" + bytes(raw[8:HEADER_BYTES]) + bytes(raw[HEADER_BYTES:-2]))
    # Two bytes short: the file, and its size on disk against the header's.
    with raises_naming(ConfigError, shard, f"{shard.stat().st_size} bytes", "header"):
        build_data(*data_args(cfg), tok, 0, 1)


RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from torchllm.config import load_config
from torchllm.data import Batching, build_data, build_tokenizer
dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
cfg = load_config(sys.argv[2:])
tok = build_tokenizer(cfg.data, out + "/data")  # auto: rank 0 trains, rank 1 waits at the barrier
batching = Batching.of(cfg.training, cfg.job, cfg.model)
loader, _ = build_data(cfg.data, cfg.validation, batching, tok, rank, dist.get_world_size())
it = iter(loader)
first = [next(it) for _ in range(3)]
state = loader.state_dict()
after = [next(it) for _ in range(3)]
torch.save({"first": first, "after": after, "state": state}, f"{out}/rank{rank}.pt")
dist.destroy_process_group()
from torchllm.run.process_exit import exit_process
exit_process(0)  # not a plain exit: see torchllm.run.process_exit
"""


@pytest.mark.slow
def test_two_gloo_ranks_share_one_tokenizer_split_the_data_and_resume(tmp_path):
    from builders.launch import fork_ranks

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    args = [f"--job.dump_folder={tmp_path}", "--data.tokenizer_vocab_size=512",
            "--training.seq_len=32", "--data.num_workers=2"]
    proc = fork_ranks(script, 2, str(tmp_path), *args, "--training.local_batch_size=2",
                      logs=tmp_path / "logs", timeout=300)  # (the ranks torchrun would start)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["tokenizer_embedded_sp512.model"]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    cfg = tiny_config(tmp_path, *args, "--data.num_workers=0", "--training.local_batch_size=4")
    tok = build_tokenizer(cfg.data, tmp_path / "data")  # the cached file
    single = take(build_data(*data_args(cfg), tok, 0, 1)[0], 6)
    joined = [{k: torch.cat([r[part][i][k] for r in ranks]) if single[0][k].dim()
               else sum(r[part][i][k] for r in ranks) for k in single[0]}  # (counts: summed)
              for part in ("first", "after") for i in range(3)]
    assert_batches_equal(joined, single)
    for r, saved in enumerate(ranks):  # each rank's saved state resumes in a new process
        cfg2 = tiny_config(tmp_path, *args, "--training.local_batch_size=2")
        loader, _ = build_data(*data_args(cfg2), tok, r, 2)
        loader.load_state_dict(saved["state"])
        assert_batches_equal(take(loader, 3), saved["after"])
