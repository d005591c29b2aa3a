"""Every command in the shell code blocks of README.md and docs/*.md runs as written.

A code block whose language is empty, sh, bash or shell holds commands, one per line (a trailing
backslash continues a line; `# ...` is a comment). Syntax summaries go in ```text blocks and
code in ```python / ```toml blocks. Each command runs, in document order, in a fresh copy of
the repository with tiny settings appended (TINY below: the same flags a user would add, parsed
by the same code). A plain one-process `./run_train.sh` or `python -m torchllm.X` line runs in
the test's process through tests/cli.py (what the command runs, minus an interpreter start: see
in_process), as does `python benchmarks/X.py` / `python scripts/X.py` (the file run as
__main__); pipelines, shell programs and several ranks run as processes. A command
is skipped only for a reason in SKIP (network, more processes than this machine has, a server,
a cluster). The README's commands are the newcomer path: fresh clone, set-up, train, generate,
evaluate, export.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from builders.docs import commands
from conftest import REPO

pytestmark = pytest.mark.e2e  # what users type: the e2e tier (-m e2e)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

RUN_TINY = ["--training.steps=3", "--training.seq_len=32", "--training.local_batch_size=2",
            "--data.tokenizer_vocab_size=512", "--metrics.log_freq=1",
            "--lr_scheduler.warmup_steps=1", "--training.global_batch_size=-1",
            "--validation.steps=2"]  # where a config validates (the speedrun: every window)
# The end-of-run report (matplotlib: ~2.5 CPU-s a launch) only where a later command reads it.
REPORT_READ = {("README.md", "./run_train.sh")}  # (document, command): `cat .../report.md`
# Appended to every command of this program (argparse and the config loader: last value wins).
TINY = {
    "./run_train.sh": RUN_TINY,
    "python -m torchllm.train": [],
    "python -m torchllm.generate": ["--max-new-tokens", "4"],
    "python -m torchllm.eval.hellaswag": ["--data", "hellaswag_val.jsonl", "--limit", "4"],
    "torchrun -m torchllm.eval.hellaswag": ["--data", "hellaswag_val.jsonl", "--limit", "4"],
    "python -m torchllm.hf export": [],
    # the target model of an import is the config's: the tiny run's shape
    "python -m torchllm.hf import": ["--training.seq_len=32",
                                                "--data.tokenizer_vocab_size=512"],
    "python -m torchllm.tools.model_info": [],
    "python -m torchllm.report": [],
    "python -m torchllm.eval.loss": ["--steps", "2", "--max-tokens", "2000"],
    "python -m torchllm.tools.estimate_memory": [],
    # the plan of the same model two blocks deep (a 70B's 80 fake blocks: ~3 CPU-s more)
    "python -m torchllm.tools.dry_run": ["--model.n_layers=2"],
    "python -m torchllm.tools.env_check": [],
    "python scripts/mutation_check.py": [],
    # (bf16 is emulated on a CPU without AVX512_BF16/AMX: ~12x slower than fp32)
    "python benchmarks/bench_throughput.py": ["--vocab", "2048", "--precisions", "fp32"],
    # (tests/unit/benchmarks/test_time_to_loss.py runs all three contenders, shortened, and
    # reads the JSON)
    "python benchmarks/bench_time_to_loss.py": ["--contenders", "reference", "--steps", "2",
                                                "--rounds", "1", "--text", "shakespeare.txt"],
    # (their --data-dir data/evals: what the fetch command leaves, see fixtures)
    "python -m torchllm.eval.downstream": ["--limit", "4"],
    "torchrun -m torchllm.eval.downstream": ["--limit", "4"],
    "python -m torchllm.eval.fetch": [],
    "python -m torchllm.eval.harness": ["--limit", "4"],
    "torchrun -m torchllm.eval.harness": ["--limit", "4"],
    "ls": [],
    "cat": [],
    "python benchmarks/bench_parallel.py": ["--matrix", "ddp", "--ac", "none", "--compile",
                                            "off", "--float8", "off", "--steps", "1",
                                            "--repeats", "1",
                                            "--warmup", "2", "--model.flavor=debug",
                                            "--data.tokenizer_vocab_size=512",
                                            "--training.seq_len=32",
                                            "--training.local_batch_size=2"],
    "python -m torchllm.tools.train_tokenizer": ["--vocab-size", "400"],
    # one row of one process (tests/unit/benchmarks/test_bench_memory.py runs a pipeline row too)
    "python benchmarks/bench_memory.py": ["--layouts", "single"],
    "python -m torchllm.data.prepare": ["--workers", "1", "--shard-tokens", "50_000"],
}
# Training with these configs would stream FineWeb-Edu and fetch a Hub tokenizer: offline
# here, it trains the same way on the embedded corpus with an auto-trained tokenizer.
OFFLINE = {"llama3_1b.toml": ["--data.dataset=embedded", "--data.tokenizer=auto",
                              "--model.flavor=debug", "--model.vocab_size=512"]}
SKIP = {  # substring of the command -> why it does not run here
    "pip install": "installs packages (network); the test runs in the environment set up already",
    "pytest": "the test suite itself",
    "tensorboard --logdir": "starts a server that runs until stopped",
    "sbatch ": "needs a SLURM cluster",
    "gpt2_124m_fineweb": "the GPT-2 recipe needs 8 GPUs and network (FineWeb-Edu, GPT-2 tokenizer)",
    "fetch_gpu_wheels.sh": "downloads wheels from the package index (network)",
    "gpu_check.sh": "the GPU acceptance run (minutes; its pieces have their own CPU tests)",
    "bench_gpu.py": "the 1B throughput run on a GPU (its CPU path: "
                    "tests/unit/tools/test_cluster_tools.py)",
    "bench_fault_tolerance.py": "a lighthouse, 2 replica groups and a plain run, each killed and "
                                "relaunched: minutes (tests/unit/ft/test_fault_tolerance.py runs "
                                "the same)",
    "bench_revisions.py": "checks out a git revision (a fresh copy here is no clone) and runs "
                          "two trees' configs: tests/unit/benchmarks/test_bench_revisions.py "
                          "runs it",
    "bench_semi_sync.py": "4 runs of a lighthouse and 2 replica groups: minutes "
                          "(tests/unit/ft/test_ft_semi_sync.py runs two DiLoCo groups the same "
                          "way)",
}
# Documents whose training commands each start their own run: parallelism.md launches the same
# config under other layouts, and resuming a run under another data-parallel degree is refused
# by design (the data order depends on it), so each launch gets a run name of its own.
OWN_RUN = {"parallelism.md", "data.md"}  # data.md: runs on several prepared datasets
# run_train.sh's variables that become launcher options: a line that sets one of them (but
# CONFIG_FILE, and NGPU / NPROC = 1) runs the script itself.
SCRIPT_ENV = {"NGPU", "NPROC", "LOG_RANK", "LOG_DIR", "NNODES", "NODE_RANK", "MASTER_ADDR",
              "MASTER_PORT", "RDZV_ENDPOINT", "RDZV_ID"}
# TORCHLLM_DOCS_TIMES=FILE: each command's CPU and wall seconds are appended to FILE.
TIMES = os.environ.get("TORCHLLM_DOCS_TIMES")
MAX_PROCESSES = 2  # commands asking for more processes (GPUs) than this are skipped
# What a documented command's console must carry besides its exit code 0: (document, command as
# written) -> strings. The launch is the one a user types, so no other test starts it again.
PRINTS = {
    # FSDP2 over 2 torchrun workers: the layout, every step, and the batch's split (TINY's
    # local batch 2, sequence 32, global batch -1 = every rank's)
    ("parallelism.md", "NGPU=2 ./run_train.sh --parallelism.data_parallel_shard_degree=2"): (
        "FSDP2 replicate=1 shard=2", "done: step 3/3, 3 steps",
        "global batch 4 seqs x 32 tokens = 2 local x 2 dp x 1 accumulation"),
}


def program(command: str) -> str:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if words[:3] == ["python", "-m", "torchllm.hf"]:
        return " ".join(words[:4])  # export / import
    if words[:2] == ["python", "-m"]:
        return " ".join(words[:3])
    if words[0] == "python" and words[1:2] and words[1].endswith(".py"):
        return " ".join(words[:2])  # python SCRIPT
    if words[0] == "torchrun":
        module = words[words.index("-m") + 1] if "-m" in words else "?"
        return f"torchrun -m {module}"
    return words[0]


def processes(command: str) -> int:
    m = re.search(r"(?:NGPU=|--nproc(?:_per_node)?[ =])(\d+)", command)
    return int(m.group(1)) if m else 1


def skip_reason(command: str) -> str | None:
    for text, reason in SKIP.items():
        if text in command:
            return reason
    if processes(command) > MAX_PROCESSES:
        return f"needs {processes(command)} GPUs (more processes than this machine's cores)"
    return None


def all_commands():
    return [(path, n, cmd) for path in DOCS for n, cmd in commands(path)]


def test_every_documented_command_is_runnable_or_skipped_for_a_stated_reason():
    found = all_commands()
    assert len(found) > 20
    programs = {program(c) for _, _, c in found}
    assert {"./run_train.sh", "python -m torchllm.generate", "python -m torchllm.eval.hellaswag",
            "python -m torchllm.hf export"} <= programs
    for path, n, cmd in found:
        where = f"{path.relative_to(REPO)}:{n}: {cmd}"
        assert "[--" not in cmd and "..." not in cmd, f"{where}: a synopsis; use a ```text block"
        assert skip_reason(cmd) or program(cmd) in TINY, f"{where}: add it to TINY or SKIP"
    skipped = [c for _, _, c in found if skip_reason(c)]
    # The skip list stays small: installs, the suite itself, servers, and commands that need
    # GPUs, clusters or the network (gpu.md and the GPU sections add most of those), and the
    # fault-tolerance benchmarks (several launches killed and relaunched, or 3 runs of 2 replica
    # groups: minutes; its per-step cost alone: tests/integration/test_ft_overlap.py runs it), and
    # the revision benchmark (a git checkout; its own test runs it).
    assert len(skipped) <= 24, skipped
    # The lines that run as processes (not in this process: see in_process) stay few: several
    # ranks (torchrun, NGPU=2) and shell programs (cat, ls). A new one is a new launch in the
    # e2e tier.
    launched = [c for _, _, c in found if not skip_reason(c) and in_process(c) is None]
    assert len(launched) <= 8, launched


def fresh_clone(dest: Path) -> Path:
    """The repository's files as a fresh clone has them (tracked + new, not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True)
    if listed.returncode != 0:  # a copy of the tree without git (scripts/mutation_check.py)
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", "__pycache__", "*.egg-info", "outputs", ".pytest_cache", "*.pyc", "build",
            "dist"))
        return dest
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def fixtures(clone: Path) -> None:
    """The input files the docs' examples name (`corpus/`, `more.jsonl`, HellaSwag's jsonl)."""
    from builders.eval import write_tiny_jsonl

    from torchllm.data.sources.embedded import embedded_documents

    docs = list(embedded_documents())
    (clone / "corpus").mkdir()
    for i, text in enumerate(docs[:30]):
        (clone / "corpus" / f"{i:03d}.txt").write_text(text)
    (clone / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[30:40]))
    write_tiny_jsonl(clone / "hellaswag_val.jsonl")
    official = REPO.parent / "shared" / "data" / "hellaswag_val.jsonl"
    if official.is_file():  # the head of the official file: every column (lm-eval's too)
        head = official.read_text().splitlines(keepends=True)[:20]
        (clone / "hellaswag_val.jsonl").write_text("".join(head))
    # bench_time_to_loss's --text: the head of tiny Shakespeare (validating on the whole 10%
    # held out of the full 1.1 MB costs a smoke run ~6 CPU-s)
    shakespeare = (REPO / "torchllm/data/assets/tinyshakespeare.txt").read_text()
    (clone / "shakespeare.txt").write_text(shakespeare[:20_000])
    # The docs name ../shared (the tokenizers and eval sets beside the checkout), as a checkout has.
    shared, beside = REPO.parent / "shared", clone.parent / "shared"
    if shared.exists() and not beside.exists():
        beside.symlink_to(shared)
    # data/evals as `python -m torchllm.eval.fetch --out data/evals` leaves it (evaluation.md):
    # the task copies of ../shared, HellaSwag's official-format file; the fetch commands then
    # find every task there (no network) but the one they prepare from a file.
    evals = clone / "data" / "evals"
    evals.mkdir(parents=True, exist_ok=True)
    if (shared / "data" / "evals").is_dir():
        for task in (shared / "data" / "evals").iterdir():
            if not (evals / task.name).exists():
                (evals / task.name).symlink_to(task)
    shutil.copyfile(clone / "hellaswag_val.jsonl", evals / "hellaswag.jsonl")
    # data.md's placeholders for the tokenizer files a user fetched once (its "Offline").
    for name, source in (("gpt2.tiktoken", "tokenizers/gpt2/gpt2.tiktoken"),
                         ("llama3_tokenizer.model", "tokenizers/llama3/tokenizer.model")):
        if (shared / source).is_file():
            (clone / name).symlink_to(shared / source)


def to_run(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of the commands of a document that run here."""
    return [(n, cmd) for n, cmd in commands(path) if not skip_reason(cmd)]


def in_process(command: str) -> tuple | None:
    """How a documented line runs in this process, through tests/cli.py, or None (a process):
    `[VAR=value ...] ./run_train.sh ARGS` with one process -> ("train", CONFIG_FILE or the
    script's default, the other variables, ARGS); `[VAR=value ...] python -m torchllm.X ARGS` ->
    ("module", "torchllm.X", variables, ARGS). The same code the command runs, minus an
    interpreter start; `python benchmarks/X.py ARGS` or `python scripts/X.py ARGS` -> ("script",
    the file, variables, ARGS): the file run as __main__ (the ranks a benchmark starts are its
    own processes). Pipelines, redirections, globs, several ranks, torchrun and shell programs
    stay processes."""
    from cli import DEBUG_CONFIG

    if any(c in command for c in "|&;<>$`*?(){}~"):
        return None  # the shell's own syntax
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[:1] == ["./run_train.sh"]:
        config = env.pop("CONFIG_FILE", DEBUG_CONFIG)
        for key in ("NGPU", "NPROC"):  # one process: the launcher trains in its own process
            if env.get(key) == "1":
                env.pop(key)
        if SCRIPT_ENV & set(env):
            return None
        return "train", config, env, words[1:]
    if words[:2] == ["python", "-m"] and words[2:3] and words[2].startswith("torchllm"):
        return "module", words[2], env, words[3:]
    if words[:1] == ["python"] and words[1:2] and words[1].endswith(".py") and \
            words[1].split("/")[0] in ("benchmarks", "scripts"):
        return "script", words[1], env, words[2:]
    return None


# What the documents' commands get, as the environment of a process or of a call in this one.
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
STDIN = "The meaning of life is\nPython\n"  # generate --interactive's prompts


def run_command(full: str, clone: Path) -> tuple[int, str]:
    """Run one command line (with its tiny settings) in `clone`: in this process if it can
    (in_process), else as a process of bash; returns (exit code, console)."""
    how = in_process(full)
    if how is None:
        env = {**os.environ, "PYTHONPATH": str(clone), **ENV}
        proc = subprocess.run(["bash", "-c", full], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=600, input=STDIN)
        return proc.returncode, proc.stdout + proc.stderr
    from cli import run_module, run_script, run_train

    kind, what, env, args = how
    if kind == "train":
        ran = run_train(*args, config=what, env={**ENV, **env}, cwd=clone, stdin=STDIN)
    elif kind == "script":  # (the processes it starts import the clone's torchllm too)
        ran = run_script(what, *args, env={**ENV, "PYTHONPATH": str(clone), **env}, cwd=clone,
                         stdin=STDIN)
    else:
        ran = run_module(what, *args, env={**ENV, **env}, cwd=clone, stdin=STDIN)
    return ran.returncode, ran.out


def run_document(path: Path, clone: Path, done: dict | None = None) -> list[tuple[str, str]]:
    """Run a document's commands (those that run here) in order in `clone`; a line
    that an earlier document ran in the clone (in `done`) is not run again: its run and files
    are there (README's newcomer run, which the docs' plain `./run_train.sh` trains). Returns
    (command, output) of each run."""
    ran = []
    done = {} if done is None else done  # line -> the document that ran it
    for n, cmd in to_run(path):
        extra = list(TINY[program(cmd)])
        if program(cmd) == "./run_train.sh":  # training reads the data and the tokenizer
            extra += [a for name, flags in OFFLINE.items() if name in cmd for a in flags]
            if path.name in OWN_RUN:
                extra.append(f"--job.run_name={path.stem}_{n}")
            if (path.name, cmd) not in REPORT_READ:
                extra.append("--metrics.report=false")
        full = cmd + " " + shlex.join(extra)
        if done.setdefault(cmd, path.name) != path.name:
            continue
        wall, times = time.perf_counter(), os.times()
        code, out = run_command(full, clone)
        if TIMES:  # CPU seconds (user + system, with a process's children) and wall seconds
            after = os.times()
            used = sum(after[:4]) - sum(times[:4])
            with open(TIMES, "a") as f:
                f.write(f"{used:7.1f} {time.perf_counter() - wall:6.1f}  "
                        f"{'' if in_process(full) else '(process) '}{path.name}:{n}: {full}\n")
        assert code == 0, f"{path.name}:{n}: {full}\n{out[-4000:]}"
        ran.append((cmd, out))
    return ran


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory, request):
    """README's commands, in order, in a fresh clone; then each selected docs/*.md's there.

    README's first command trains outputs/debug_model, which the rest and the docs read. The
    documents run one after the other, each document's commands in order, a command line that
    an earlier document ran (its files are there) once. No two documents write the same run
    (own run names, or OWN_RUN) or file.
    Returns (clone, README's (command, output) list, {doc: its exception or its (command,
    output) list})."""
    clone = fresh_clone(tmp_path_factory.mktemp("clone"))
    fixtures(clone)
    done: dict = {}
    ran = run_document(REPO / "README.md", clone, done=done)
    selected = sorted({item.callspec.params["doc"] for item in request.session.items
                       if item.originalname == "test_documented_commands_run"})
    results = {}
    for doc in selected:
        try:
            results[doc] = run_document(REPO / "docs" / doc, clone, done=done)
        except BaseException as e:  # reported by that document's test
            results[doc] = e
    return clone, ran, results


@pytest.mark.slow
def test_newcomer_path_from_a_fresh_clone(newcomer):
    clone, ran, _ = newcomer
    outputs = dict(ran)
    train = next(o for c, o in ran if c == "./run_train.sh")
    assert "run debug_model" in train and "effective config" not in train
    assert (clone / "outputs/debug_model/checkpoint/step-3/COMPLETE").is_file()
    assert len(list((clone / "outputs/debug_model/checkpoint").glob("step-*"))) == 1  # keep 1
    generated = outputs['python -m torchllm.generate --checkpoint outputs/debug_model '
                        '--prompt \'The meaning of life is\'']
    assert "### prompt 1\nThe meaning of life is\n### completion 1\n" in generated
    chat = next(o for c, o in ran if "--interactive" in c)
    assert "The meaning of life is" in chat and "Python" in chat
    assert "acc_norm" in next(o for c, o in ran if "hellaswag" in c)
    assert (clone / "hf/debug_model/config.json").is_file()
    assert list((clone / "outputs/tb/debug_model").glob("events.out.tfevents.*"))
    report = next(o for c, o in ran if c.startswith("cat outputs/debug_model/report/"))
    assert "![loss](loss.png)" in report and (clone / "outputs/debug_model/train.log").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("doc", [p.name for p in DOCS[1:]])
def test_documented_commands_run(newcomer, doc):
    """Each docs/*.md's commands run as written (see the newcomer fixture), and print what
    PRINTS names."""
    ran = newcomer[2][doc]
    if isinstance(ran, BaseException):
        raise ran
    outputs = dict(ran)
    for (name, cmd), strings in PRINTS.items():
        if name == doc:
            assert cmd in outputs, f"{doc}: no command {cmd!r} ran (PRINTS)"
            for text in strings:
                assert text in outputs[cmd], f"{doc}: {cmd}: no {text!r}\n{outputs[cmd][-4000:]}"
