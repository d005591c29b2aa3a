"""Golden loss curves: the first STEPS training losses and the final validation loss of tiny runs
(each model family, a data mixture, SFT on conversations, expert / pipeline / context parallelism
on 2 gloo ranks), recorded on CPU in float32 and compared at 1e-5 relative; plus a checkpoint
written by the recording commit's code that the current code must resume exactly (the losses of
the steps after it, from the recording's straight run). They guard refactors: a change that
moves nothing must keep every curve.

Re-record (each run twice, to check that it repeats bit for bit; a few minutes on 2 cores):

    PYTHONPATH=$PWD python tests/integration/test_golden_curves.py --record            # every curve
    PYTHONPATH=$PWD python tests/integration/test_golden_curves.py --record llama sft  # some runs
    PYTHONPATH=$PWD python tests/integration/test_golden_curves.py --record resume     # checkpoint

The rule: a change that moves a curve updates tests/golden/ in the same commit, and its message
says why the numbers moved (a fixed bug, a new default, a reordered sum, ...). A curve that moves
without such a reason is a regression. The checkpoint is re-recorded only when named ("resume"):
the current code then writes it, so do that only when the losses after a resume move for a
stated reason or older checkpoints are deliberately no longer loadable.

Everything is local and fixed: the text is generated here by a fixed integer
generator (not the embedded corpus, which changes with the Python version), the tokenizer is
`bytes` (nothing trained), the shapes are the debug flavors shrunk by --model.* overrides.
Runs use one thread (train()). Tolerance: each run repeats bit for bit on one machine (checked
when recording); PP=2 and CP=2 differ from the one-process Llama curve by <= 2e-7 relative and a
2-thread GPT-2 from a 1-thread one by 1e-7 (summation order alone), so 1e-5 relative leaves room
for another CPU's summation order and is far below what the planted bugs move (scripts/
mutation_check.py: golden_init_std, golden_rope_theta_default, golden_warmup_off_by_one, and
golden_checkpoint_key_renamed for the checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
CURVES = GOLDEN / "curves.json"
RESUME = GOLDEN / "resume"  # the launch config, the checkpoint and the straight run's losses
RTOL = 1e-5
STEPS = 8

# What every run shares: CPU float32, small batches of 32 bytes, 2 warm-up steps, and one
# validation (2 batches) after the last step. {tmp}: the run's folder, {data}: the text files.
BASE = (
    "--training.device=cpu", "--training.mixed_precision=none", "--job.print_config=false",
    "--metrics.report=false", "--metrics.log_freq=1", f"--training.steps={STEPS}",
    "--training.seq_len=32", "--training.local_batch_size=4", "--lr_scheduler.warmup_steps=2",
    "--optimizer.lr=1e-3", "--data.tokenizer=bytes", "--data.dataset=local:{data}/text.jsonl",
    "--validation.enable", "--validation.freq=1000", "--validation.steps=2",
    "--job.deterministic", "--job.dump_folder={tmp}",
)
SMALL = ("--model.flavor=debug", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4",
         "--model.hidden_dim=128")
LLAMA = ("--model.name=llama3", *SMALL, "--model.n_kv_heads=2")
GPT2 = ("--model.name=gpt2", *SMALL)
QWEN3 = ("--model.name=qwen3", *SMALL, "--model.n_kv_heads=2", "--model.head_dim=16")
QWEN3_MOE = ("--model.name=qwen3_moe", *SMALL, "--model.n_kv_heads=2", "--model.head_dim=16")
SINGLE = {  # one process each, in the test's process
    "llama": LLAMA,
    "gpt2": GPT2,
    "qwen3": QWEN3,
    "mixture": (*LLAMA, "--data.sources=local:{data}/a.jsonl=0.7,local:{data}/b.jsonl=0.3"),
    "sft": (*LLAMA, "--data.dataset=chat:{data}/chat.jsonl", "--training.seq_len=64"),
}
TWO_RANKS = {  # one launch of 2 gloo ranks (fork_ranks), the runs one after the other
    "qwen3_moe_ep2": (*QWEN3_MOE, "--parallelism.expert_parallel_degree=2",
                      "--training.local_batch_size=2"),
    "llama_pp2": (*LLAMA, "--parallelism.pipeline_parallel_degree=2"),
    "llama_cp2": (*LLAMA, "--parallelism.context_parallel_degree=2"),
}


def run_args(name: str, tmp: Path, data: Path) -> list[str]:
    spec = {**SINGLE, **TWO_RANKS}[name]
    return [a.format(tmp=tmp, data=data) for a in (*BASE, *spec, f"--job.run_name={name}")]


def spec_of(name: str) -> list[str]:
    """The run's arguments as recorded (placeholders unformatted)."""
    return [*BASE, *{**SINGLE, **TWO_RANKS}[name], f"--job.run_name={name}"]


# --- the data: written by the test, the same bytes everywhere ---------------------------------

WORDS = ("the river ran under old stone bridges while small boats carried bread salt and letters "
         "between quiet towns where children learned to count stars name winds and mend nets "
         "before winter came down from grey hills").split()


def sentences(n: int, seed: int, lo: int = 6, hi: int = 30) -> list[str]:
    """n sentences of WORDS drawn by a 64-bit LCG (no library RNG whose stream could change)."""
    state, out = seed, []

    def draw(k: int) -> int:
        nonlocal state
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        return (state >> 33) % k

    for _ in range(n):
        words = [WORDS[draw(len(WORDS))] for _ in range(lo + draw(hi - lo))]
        out.append(" ".join(words).capitalize() + ".")
    return out


def write_data(folder: Path) -> Path:
    """text.jsonl (the default source), a.jsonl and b.jsonl (the mixture), chat.jsonl (SFT)."""
    folder.mkdir(parents=True, exist_ok=True)

    def jsonl(name: str, rows: list[dict]) -> None:
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("text.jsonl", [{"text": " ".join(sentences(5, seed))} for seed in range(200)])
    jsonl("a.jsonl", [{"text": " ".join(sentences(4, 1000 + s))} for s in range(120)])
    jsonl("b.jsonl", [{"text": " ".join(sentences(4, 2000 + s, 2, 8))} for s in range(120)])
    chats = []
    for s in range(200):  # short turns: most conversations fit a 64-byte window whole
        q, a, q2, a2 = sentences(4, 3000 + s, 1, 5)
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if s % 3 == 0:
            turns = [{"role": "system", "content": "Answer briefly."}, *turns]
        if s % 2 == 0:
            turns += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        chats.append({"messages": turns})
    jsonl("chat.jsonl", chats)
    return folder


# --- running ------------------------------------------------------------------------------------

def train(args: list[str]) -> dict:
    """{loss: [per step], val_loss: after the last step} of one run (every rank calls it).

    On one thread: the same summation order whatever the machine's core count (and no OpenMP
    threads spinning against the other processes of a loaded machine: 20x faster here)."""
    import torch

    from torchllm.config import load_config
    from torchllm.train import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(load_config(args))
        losses = trainer.train()
    finally:
        torch.set_num_threads(threads)
    step, val = trainer.evaluator.last_val
    assert step == STEPS, (step, args)
    return {"loss": losses, "val_loss": val}


def launch_two_ranks(names: list[str], tmp: Path, data: Path) -> dict:
    """Every named 2-rank run in one launch of this file on 2 gloo ranks (see worker(); the
    ranks forked as builders.launch.fork_ranks does: torchrun's variables, one thread)."""
    from builders.launch import fork_ranks, launch_failure

    tmp.mkdir(parents=True, exist_ok=True)
    spec, out = tmp / "two_ranks.json", tmp / "two_ranks_out.json"
    spec.write_text(json.dumps({n: run_args(n, tmp, data) for n in names}))
    proc = fork_ranks(__file__, 2, "--worker", str(spec), str(out), logs=tmp / "two_ranks_logs")
    assert proc.returncode == 0, launch_failure(proc)
    return json.loads(out.read_text())


def worker(spec_path: str, out_path: str) -> None:
    """On each of the 2 ranks: train each run of the spec; rank 0 writes {name: curve}."""
    import torch.distributed as dist

    from torchllm.parallel import destroy_distributed

    results = {name: train(args) for name, args in json.loads(Path(spec_path).read_text()).items()}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    destroy_distributed()


def run_train_sh(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPU": "1", "OMP_NUM_THREADS": "1",
           "CONFIG_FILE": str(RESUME / "config.toml"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["./run_train.sh", f"--job.dump_folder={tmp}", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def tb_losses(tmp: Path, run: str) -> dict[int, float]:
    from conftest import tb_scalars

    return tb_scalars(tmp / "tb" / run)


def resume_data(tmp: Path) -> list[str]:
    """The data of the resume run, and validation on (once, after the last step): the recorded
    run held the last data.val_fraction out of training, as a run does only when it validates
    (with validation off every window trains)."""
    return [f"--data.dataset=local:{write_data(tmp / 'data') / 'text.jsonl'}",
            "--validation.enable", "--validation.freq=1000"]


# --- the tests ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden() -> dict:
    if not CURVES.is_file():
        pytest.fail(f"{CURVES} is missing: record it with "
                    "`PYTHONPATH=$PWD python tests/integration/test_golden_curves.py --record`")
    return json.loads(CURVES.read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("golden_data"))


def assert_curve(name: str, got: dict, golden: dict) -> None:
    if name not in golden:
        pytest.fail(f"{CURVES} has no curve {name!r}: record it with `PYTHONPATH=$PWD python "
                    f"tests/integration/test_golden_curves.py --record {name}`")
    want = golden[name]
    assert want["args"] == spec_of(name), (
        f"{name}: the run's arguments changed since the curve was recorded; re-record it "
        f"(python tests/integration/test_golden_curves.py --record {name}) and say why in the "
        f"commit")
    assert len(got["loss"]) == len(want["loss"]) == STEPS
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL, abs=0), (
        f"{name}: the training curve moved (got, golden):\n{got['loss']}\n{want['loss']}")
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=RTOL, abs=0), (
        f"{name}: the validation loss moved: {got['val_loss']} vs golden {want['val_loss']}")


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_single_process_curve(name, data, golden, tmp_path):
    assert_curve(name, train(run_args(name, tmp_path, data)), golden)


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> dict:
    return launch_two_ranks(sorted(TWO_RANKS), tmp_path_factory.mktemp("golden2"), data)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TWO_RANKS))
def test_two_rank_curve(name, two_ranks, golden):
    assert_curve(name, two_ranks[name], golden)


@pytest.mark.slow  # two processes start (the launcher, the rank): ~10 s
def test_recorded_checkpoint_resumes_exactly(tmp_path):
    """The checkpoint the recording commit's code wrote at step 3, copied into a fresh run
    folder, resumed by ./run_train.sh: steps 4.. repeat the straight run's losses (dropout on,
    so the restored RNG state counts too)."""
    want = json.loads((RESUME / "losses.json").read_text())
    run = tmp_path / "golden_resume"
    shutil.copytree(RESUME / "checkpoint", run / "checkpoint")
    proc = run_train_sh(tmp_path, *resume_data(tmp_path))
    assert f"step-{want['resume_step']}" in proc.stdout + proc.stderr
    got = tb_losses(tmp_path, "golden_resume")
    steps = [int(s) for s in want["losses"]]
    assert sorted(got) == steps, f"the resumed run logged steps {sorted(got)}, not {steps}"
    assert [got[s] for s in steps] == pytest.approx(list(want["losses"].values()), rel=RTOL,
                                                    abs=0)


# --- recording ----------------------------------------------------------------------------------

def record_curves(names: list[str], tmp: Path) -> None:
    """Run each named run twice (it must repeat bit for bit), then write it into curves.json."""
    data = write_data(tmp / "data")
    curves = json.loads(CURVES.read_text()) if CURVES.is_file() else {}
    got = {}
    for attempt in ("a", "b"):
        here = tmp / attempt
        runs = {n: train(run_args(n, here, data)) for n in names if n in SINGLE}
        multi = [n for n in names if n in TWO_RANKS]
        if multi:
            runs.update(launch_two_ranks(multi, here, data))
        got[attempt] = runs
    for name in names:
        a, b = got["a"][name], got["b"][name]
        if not all(math.isfinite(v) for v in (*a["loss"], a["val_loss"])):
            raise SystemExit(f"{name}: a loss is not finite (a step without targets?): {a}")
        if a != b:
            raise SystemExit(f"{name} does not repeat bit for bit:\n{a}\n{b}")
        curves[name] = {"args": spec_of(name), **a}
        print(f"{name}: loss {a['loss'][0]:.6f} .. {a['loss'][-1]:.6f}, val {a['val_loss']:.6f}")
    CURVES.parent.mkdir(parents=True, exist_ok=True)
    CURVES.write_text(json.dumps(dict(sorted(curves.items())), indent=1) + "\n")


def record_resume(tmp: Path) -> None:
    """A straight run saving step RESUME_STEP; keep that checkpoint and the losses after it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    cfg = tomllib.loads((RESUME / "config.toml").read_text())
    resume_step = cfg["checkpoint"]["interval"]
    run_train_sh(tmp, *resume_data(tmp))
    losses = tb_losses(tmp, "golden_resume")
    ckpt = tmp / "golden_resume" / "checkpoint" / f"step-{resume_step}"
    shutil.rmtree(RESUME / "checkpoint", ignore_errors=True)
    shutil.copytree(ckpt, RESUME / "checkpoint" / ckpt.name)
    after = {str(s): v for s, v in sorted(losses.items()) if s > resume_step}
    (RESUME / "losses.json").write_text(json.dumps(
        {"resume_step": resume_step, "losses": after}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in (RESUME / "checkpoint").rglob("*") if p.is_file())
    print(f"resume: step-{resume_step} ({size / 1e3:.0f} kB), losses after it {after}")


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="Re-record the golden curves (tests/golden/).")
    parser.add_argument("--record", nargs="*", metavar="NAME",
                        help=f"runs to re-record (default: every curve): {sorted(SINGLE)}, "
                             f"{sorted(TWO_RANKS)}; 'resume' (the checkpoint) only when named")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.record is None:
        parser.error("nothing to do: pass --record [NAME ...]")
    known = {*SINGLE, *TWO_RANKS, "resume"}
    names = args.record or sorted(known - {"resume"})
    if unknown := set(names) - known:
        parser.error(f"unknown runs {sorted(unknown)}; known: {sorted(known)}")
    sys.path.insert(0, str(REPO / "tests"))
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        curves = [n for n in names if n != "resume"]
        if curves:
            record_curves(curves, Path(tmp) / "curves")
        if "resume" in names:
            record_resume(Path(tmp) / "resume")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "--worker" in sys.argv:
        from torchllm.run.process_exit import exit_process

        exit_process(code)  # after collectives: see torchllm.run.process_exit
    sys.exit(code)
