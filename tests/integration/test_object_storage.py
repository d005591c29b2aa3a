"""Checkpoints on object storage, against a real S3 endpoint (moto's server, tests/s3_server.py):
the step layout and its completeness rule on a bucket, split runs over two launches equal to a
straight run on local disk, resharding from the bucket, retention, checksums and partial uploads.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from torchllm.checkpoint.layout import complete_steps, delete_step, scan_steps, step_dir
from torchllm.checkpoint.step import read_marker, resolve_checkpoint
from torchllm.config import ConfigError
from torchllm.train import Trainer

from conftest import REPO, tiny_args, tiny_config
from s3_server import s3, s3_endpoint, s3_module  # noqa: F401 - fixtures
from builders.checkpoint import (
    COMMON,
    FSDP2,
    assert_same_tensors,
    saved_state,
    tb_losses,
    torchrun_jobs,
)


# A 64-wide, 2-block model: checkpoints of ~1 MB, not the debug flavor's ~40 MB, to write, check
# and move through the S3 server; what is saved, not how much, is the subject here.
MODEL = ("--model.dim=64", "--model.n_layers=2")


def s3fs_client():
    import s3fs

    return s3fs.S3FileSystem()


def objects(url: str) -> list[str]:
    """Every object name under `url`, relative to it."""
    root = url.split("://", 1)[1].rstrip("/") + "/"
    return sorted(k[len(root):] for k in s3fs_client().find(root))


def test_steps_on_a_bucket_complete_partial_and_their_own_prefix(s3):
    folder = f"{s3}/runs/ckpt"
    fs = s3fs_client()
    layout = {1: ["__0_0.distcp", ".metadata", "COMPLETE"], 10: ["__0_0.distcp", "COMPLETE"],
              2: ["__0_0.distcp"], 3: ["__0_0.distcp", "NONFINITE"]}
    for step, names in layout.items():
        for name in names:
            body = b'{"step": %d}' % step if name == "COMPLETE" else b"x"
            fs.pipe(f"{folder}/step-{step}/{name}", body)
    assert scan_steps(folder) == {1: "complete", 10: "complete", 2: "partial", 3: "nonfinite"}
    assert complete_steps(folder) == [1, 10]
    assert resolve_checkpoint(folder) == f"{folder}/step-10"
    assert read_marker(step_dir(folder, 10)) == {"step": 10}
    with pytest.raises(FileNotFoundError, match="incomplete"):
        resolve_checkpoint(f"{folder}/step-2")
    delete_step(step_dir(folder, 1))  # its own prefix only: step-10 shares the letters
    assert objects(folder) == ["step-10/COMPLETE", "step-10/__0_0.distcp", "step-2/__0_0.distcp",
                               "step-3/NONFINITE", "step-3/__0_0.distcp"]


def test_a_missing_s3fs_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import fsspec

    def missing(protocol):
        raise ImportError("Install s3fs to access S3")

    from torchllm import storage

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    storage._missing.cache_clear()  # a protocol is checked once per process: check it again
    try:
        with pytest.raises(ConfigError) as err:
            tiny_config(tmp_path, "--checkpoint.folder=s3://bucket/ckpt")
    finally:
        storage._missing.cache_clear()
    msg = str(err.value)
    assert "\n" not in msg and err.value.key == "checkpoint.folder"
    assert 'checkpoint.folder = s3://bucket/ckpt: s3:// needs s3fs (pip install -e ".[s3]")' in msg


MODES = {"sync": (), "async": ("--checkpoint.async_mode=async",),
         "async_mirror": ("--checkpoint.async_mode=async", "--checkpoint.local_mirror=mirror")}


@pytest.fixture(scope="module")
def split_runs(s3_module, tmp_path_factory):
    """A straight 2-rank FSDP2 run on local disk, and per mode a run split over two launches
    on the bucket (the three first halves, then the three second halves, in one launch each):
    (tmp folder, bucket)."""
    tmp = tmp_path_factory.mktemp("split")
    args = tiny_args(tmp, *COMMON, *FSDP2, *MODEL, "--training.steps=6", "--checkpoint.interval=2",
                     "--checkpoint.keep_latest_k=2")
    split = {mode: [*args, f"--job.run_name=split_{mode}",
                    f"--checkpoint.folder={s3_module}/ckpt/{mode}", *extra]
             for mode, extra in MODES.items()}
    torchrun_jobs(tmp / "first.json", [
        {"train": [*args, "--job.run_name=straight"]},
        *({"train": [*argv, "--training.stop_after_steps=3"]} for argv in split.values())])
    for mode in MODES:
        assert complete_steps(f"{s3_module}/ckpt/{mode}") == [2, 3], mode
    torchrun_jobs(tmp / "second.json", [{"train": argv} for argv in split.values()])
    return tmp, s3_module


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp2_split_run_on_s3_equals_straight_run_on_disk_and_reshards(split_runs, mode):
    """Two launches of 2-rank FSDP2 writing to and resuming from a bucket (sync, async, or
    written locally and uploaded in the background) == one launch on local disk, loss for loss
    and tensor for tensor; retention on the bucket keeps the newest 2 (each a step prefix with
    its COMPLETE marker and checksums); the bucket's step then loads into one process (2 -> 1
    ranks) with the same weights and optimizer state."""
    tmp_path, bucket = split_runs
    remote, run = f"{bucket}/ckpt/{mode}", f"split_{mode}"
    straight, resumed = tb_losses(tmp_path, "straight"), tb_losses(tmp_path, run)
    assert [s for s, _ in straight] == list(range(1, 7))
    # Every step's loss, bit for bit, each logged once: the second launch resumed at step 4
    # from the bucket's step-3 (a fresh start would log steps 1-3 again).
    assert resumed == straight
    local = tmp_path / "straight" / "checkpoint"
    assert complete_steps(local) == [4, 6]
    assert sorted({name.split("/")[0] for name in objects(remote)}) == ["step-4", "step-6"]
    marker = read_marker(step_dir(remote, 6))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(marker["files"])
    assert_same_tensors(saved_state(step_dir(remote, 6)), saved_state(local / "step-6"))
    assert not (tmp_path / run / "checkpoint").exists()  # nothing written locally
    assert (tmp_path / run / "config.toml").is_file()  # the run folder (and lock) stay local
    if mode == "async_mirror":  # written there first, deleted once uploaded
        assert (tmp_path / run / "mirror").is_dir()
        assert list((tmp_path / run / "mirror").iterdir()) == []
    if mode != "sync":
        return

    # 2 -> 1 rank: the data order belongs to 2 dp ranks and is not restored.
    one = Trainer(tiny_config(tmp_path, *COMMON, *MODEL, "--training.steps=6",
                              f"--job.run_name={run}",
                              f"--checkpoint.folder={remote}",
                              "--checkpoint.exclude_from_loading=dataloader",
                              "--checkpoint.allow_global_batch_change"))
    try:
        assert one.step == 6
        flat = {f"model.{k}": v for k, v in one.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        for fqn, state in get_optimizer_state_dict(one.model, one.optimizer)["state"].items():
            flat.update({f"optimizer.state.{fqn}.{k}": v for k, v in state.items()})
        assert_same_tensors(flat, saved_state(local / "step-6"))
    finally:
        one.close()


def test_flipped_byte_in_a_shard_object_falls_back_and_partial_steps_are_deleted(
        s3, tmp_path, caplog):
    """One byte of step 4's shard object changes on the store (same size): the checksum in
    its marker catches it and the run resumes from step 2, as a local copy of step 2 does. A
    step prefix without a marker (an upload cut short) is ignored and deleted at resume."""
    remote = f"{s3}/ckpt"
    ckpt = ("--checkpoint.enable", "--checkpoint.interval=2", "--job.run_name=run",
            f"--checkpoint.folder={remote}", *MODEL)
    Trainer(tiny_config(tmp_path, *ckpt)).train()
    assert complete_steps(remote) == [2, 4]
    fs = s3fs_client()
    shard = f"{remote}/step-4/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe(shard, bytes(data))
    fs.pipe(f"{remote}/step-6/__0_0.distcp", b"half an upload")
    reference = tiny_config(tmp_path, *MODEL, "--checkpoint.enable", "--job.run_name=ref",
                            f"--checkpoint.initial_load_path={remote}/step-2",
                            "--checkpoint.initial_load_model_only=false")
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = Trainer(tiny_config(tmp_path, *ckpt))
    try:
        assert resumed.step == 2
        assert f"file {shard} is corrupted: CRC-32" in caplog.text
        assert f"ignoring incomplete checkpoint {remote}/step-6" in caplog.text
        assert "step-6/__0_0.distcp" not in objects(remote)
        ref = Trainer(reference)
        try:
            for (name, a), b in zip(ref.model.state_dict().items(),
                                    resumed.model.state_dict().values()):
                assert torch.equal(a, b), name
        finally:
            ref.close()
    finally:
        resumed.close()


def test_overwrite_deletes_this_runs_steps_on_a_bucket_and_starts_afresh(s3, tmp_path, caplog):
    """--job.overwrite over a run that saved into a bucket: every step prefix there (complete or
    an upload cut short) is deleted, once the steps are known to be this run's, before anything
    loads, and training starts again at step 1 (another run's prefix is refused instead:
    test_identity_trust.py)."""
    caplog.set_level(logging.INFO, logger="torchllm")
    remote = f"{s3}/ckpt"
    ckpt = ("--checkpoint.enable", "--checkpoint.interval=2", "--job.run_name=run",
            f"--checkpoint.folder={remote}", *MODEL)
    Trainer(tiny_config(tmp_path, *ckpt, "--training.steps=2")).train()
    s3fs_client().pipe(f"{remote}/step-3/__0_0.distcp", b"half an upload")
    assert scan_steps(remote) == {2: "complete", 3: "partial"}
    trainer = Trainer(tiny_config(tmp_path, *ckpt, "--training.steps=1", "--job.overwrite"))
    assert trainer.step == 0 and scan_steps(remote) == {}  # nothing resumed, nothing left
    assert f"deleted this run's previous checkpoints: {remote} (2 step(s): [2, 3])" in caplog.text
    assert len(trainer.train()) == 1


@pytest.mark.slow
def test_kill_during_a_mirror_upload_leaves_a_step_that_resume_ignores_and_deletes(
        s3, tmp_path, caplog):
    """checkpoint.local_mirror: the process is killed (-9) after step 4's first file reached the
    store and before its marker: the half step is ignored and deleted at resume, which continues
    from step 2 exactly as a straight run on local disk does."""
    remote = f"{s3}/ckpt"
    ckpt = ("--checkpoint.enable", "--checkpoint.interval=2", "--job.run_name=run",
            f"--checkpoint.folder={remote}", "--checkpoint.local_mirror=mirror", *MODEL)
    sentinel = tmp_path / "uploading"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "s3_kill_worker.py"),
                                 str(sentinel), *tiny_args(tmp_path, *ckpt)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not sentinel.exists():
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "step 4's upload never started"
            time.sleep(0.2)
    finally:
        proc.kill()  # SIGKILL
        proc.wait(timeout=60)
    uploaded = sentinel.read_text()
    assert complete_steps(remote) == [2]
    assert [n for n in objects(remote) if n.startswith("step-4/")] == [f"step-4/{uploaded}"]
    straight = Trainer(tiny_config(tmp_path, *MODEL, "--checkpoint.enable",
                                   "--checkpoint.interval=2", "--job.run_name=straight")).train()
    with caplog.at_level(logging.WARNING, logger="torchllm"):
        resumed = Trainer(tiny_config(tmp_path, *ckpt))
    assert resumed.step == 2
    assert f"ignoring incomplete checkpoint {remote}/step-4" in caplog.text
    assert not [n for n in objects(remote) if n.startswith("step-4/")]
    assert resumed.train() == straight[2:]  # steps 3 and 4 again, bit for bit
    assert complete_steps(remote) == [2, 4]


def test_inference_and_hf_export_from_and_to_a_bucket(s3, tmp_path):
    """The inference tools load a step from the bucket (config read from the step, tokenizer
    from the local run folder) with the trained weights; `hf export` from the bucket to the
    bucket writes a folder that `transformers` loads, after a download, with the same logits."""
    transformers = pytest.importorskip("transformers")
    from torchllm.hf.cli import main as hf_cli
    from torchllm.eval.loading import load_for_inference

    remote = f"{s3}/ckpt"
    trainer = Trainer(tiny_config(tmp_path, *MODEL, "--checkpoint.enable", "--job.run_name=run",
                                  "--training.steps=1", f"--checkpoint.folder={remote}"))
    trainer.train()  # (it closes the trainer: the save is complete)
    model, _, tokenizer = load_for_inference(remote, "cpu")
    assert tokenizer.vocab_size == trainer.tokenizer.vocab_size
    for (name, a), b in zip(trainer.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    out = f"{s3}/hf/run"
    assert hf_cli(["export", "--checkpoint", remote, "--out", out]) == 0
    assert {"config.json", "model.safetensors"} <= set(objects(out))
    local = tmp_path / "downloaded"
    s3fs_client().get(out.split("://", 1)[1] + "/", str(local), recursive=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(local).eval()
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trainer.model.eval()(x)[..., :hf.config.vocab_size]
        assert (ours - hf(x).logits).abs().max().item() < 1e-4
    assert hf_cli(["export", "--checkpoint", remote, "--out", out]) == 2  # not over an export


# --- shards on a bucket ------------------------------------------------------------------------

def prepare_to(out: str, corpus, *extra: str) -> int:
    """`python -m torchllm.data.prepare` (its main, in this process) into `out`."""
    from torchllm.data.prepare import main as prepare_cli

    return prepare_cli(["--dataset", f"local:{corpus}", "--tokenizer", "bytes", "--out", out,
                        "--shard-tokens", "3000", "--val-tokens", "500", "--workers", "1",
                        *extra])


@pytest.mark.slow
def test_shards_on_a_bucket_train_the_same_batches_as_on_disk(s3, tmp_path, monkeypatch,
                                                             capsys):
    """`prepare --out s3://...` writes what `--out DIR` writes; each rank's batches from
    shards:s3:// equal those from the disk copy, read as ranged GETs of just its windows; and
    ./run_train.sh trains on it with the losses of the same run on disk."""
    from cli import run_train
    from builders.data import assert_batches_equal, data_args, take

    from torchllm import storage
    from torchllm.data import build_data
    from torchllm.data.sources.embedded import embedded_documents
    from torchllm.data.tokenizer import load_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(embedded_documents()[:12]):
        (corpus / f"{i:02d}.txt").write_text(text)
    url, disk = f"{s3}/corpus/bytes", tmp_path / "shards"
    assert prepare_to(url, corpus) == prepare_to(str(disk), corpus) == 0
    local_files = sorted(p.name for p in disk.iterdir())
    assert objects(url) == local_files and len(local_files) > 5  # several shards per split
    for name in local_files:
        assert s3fs_client().cat_file(f"{url}/{name}".split("://")[1]) == \
            (disk / name).read_bytes(), name
    # A used prefix is refused as a used folder is.
    assert prepare_to(url, corpus) == 2 and "already holds shards" in capsys.readouterr().err

    fetched = []
    read_range = storage.FsspecStorage.read_range
    monkeypatch.setattr(storage.FsspecStorage, "read_range", lambda self, loc, a, b: (
        fetched.append(b - a), read_range(self, loc, a, b))[1])
    tok = load_tokenizer("bytes")
    steps, seq, batch = 6, 32, 2
    for rank in range(2):
        fetched.clear()
        mine = {}
        for spec in (f"shards:{url}", f"shards:{disk}"):
            cfg = tiny_config(tmp_path, f"--data.dataset={spec}", f"--training.seq_len={seq}",
                              f"--training.local_batch_size={batch}")
            loader, _ = build_data(*data_args(cfg), tok, rank, 2)
            mine[spec] = take(loader, steps)
        assert_batches_equal(mine[f"shards:{url}"], mine[f"shards:{disk}"])
        # Headers, then one ranged read per window (two where a window spans shards): this
        # rank's windows, not the shards.
        windows = [n for n in fetched if n != 256]
        assert steps * batch <= len(windows) <= 2 * steps * batch
        assert sum(windows) == steps * batch * (seq + 1) * 2  # uint16 tokens
        assert sum(windows) < sum((disk / n).stat().st_size for n in local_files) / 4

    args = ("--training.steps=3", "--data.tokenizer=auto", "--metrics.log_freq=1", *MODEL)
    proc = run_train(*tiny_args(tmp_path, "--metrics.progress_bar=false"),
                     f"--data.dataset=shards:{url}", "--job.run_name=on_s3", *args)
    assert proc.returncode == 0, proc.out[-3000:]
    Trainer(tiny_config(tmp_path, f"--job.config_file={REPO}/train_configs/debug_model.toml",
                        f"--data.dataset=shards:{disk}", "--job.run_name=on_disk",
                        "--metrics.progress_bar=false", *args)).train()  # as run_train.sh
    on_s3, on_disk = tb_losses(tmp_path, "on_s3"), tb_losses(tmp_path, "on_disk")
    assert len(on_s3) == 3 and on_s3 == on_disk
