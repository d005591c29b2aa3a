"""Is this tree no slower than an earlier revision? The same configs, from both, side by side.

    python benchmarks/bench_revisions.py --before REV [--configs debug_model,speedrun_shakespeare_cpu]
        [--steps 30] [--rounds 3] [--threads 1] [--overrides "--section.key=value ..."] [--json PATH]

REV is any git revision of this repository, checked out once into a temporary worktree
(`git worktree add --detach`, removed at the end), or the folder of another checkout. For each round and each config the two trees
run alternately (before, after, before, ...) so they share the machine's moments: a fresh
`./run_train.sh --training.steps=N --metrics.log_freq=1` of the config, from that tree's own
folder with its own code first on PYTHONPATH, into a scratch dump folder (checkpoints, validation
and samples off: the training step alone is timed). Measured per run: the median step time over
the steps after the first two (the step line's `step NNNms`; the first steps include one-time
warm-up) and the run's CPU seconds (user + system of the whole process tree, from
getrusage(RUSAGE_CHILDREN)), which a loaded machine inflates less than wall time. `--threads`
sets OMP_NUM_THREADS for both (default 1: a busy 2-core machine gives the two trees the same one
core more fairly than two). Reported per config: the median over rounds of each tree's median
step time and CPU seconds, and after / before. The machine's class is detected at run time and
printed with the table; compare only figures from one sitting. `--overrides` are appended to
every run of both trees (e.g. a smaller shape). Each tree's runs import that tree's own
torchllm (checked before its first run: an editable install of another checkout on the path
would otherwise time one tree twice).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchllm.precision import cpuinfo  # noqa: E402

_STEP = re.compile(r"step\s+(\d+)/\d+ .*?\| step (\d+)ms")
_QUIET = ("--checkpoint.enable=false", "--validation.enable=false", "--metrics.log_freq=1",
          "--eval.sample_freq=0", "--validation.stop_at_loss=0", "--job.overwrite")
# validation.enable=false: no held-out pass; checkpoint.enable=false: no save at the end.


def in_tree(tree: Path, threads: int, **env: str) -> dict:
    """subprocess.run's cwd and env for a process of `tree`: its folder, its code first."""
    return {"cwd": tree,
            "env": dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads), **env)}


def imported_from(tree: Path, threads: int) -> str:
    """Where a process started as the runs are imports torchllm from; refused unless `tree`."""
    out = subprocess.run([sys.executable, "-c", "import torchllm; print(torchllm.__file__)"],
                         **in_tree(tree, threads), capture_output=True, text=True)
    where = Path(out.stdout.strip() or ".").resolve()
    if out.returncode != 0 or not where.is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: its runs would import torchllm from {where}, not from the "
                         "tree itself: unset PYTHONPATH / uninstall the other checkout")
    return str(where.parent)


def run_once(tree: Path, config: str, steps: int, threads: int, dump: Path,
             overrides: list[str] = ()) -> dict:
    """One fresh run of `config` from `tree`: its per-step times and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        ["./run_train.sh", f"--training.steps={steps}", f"--job.dump_folder={dump}",
         "--job.run_name=bench", *_QUIET, *overrides],
        **in_tree(tree, threads, CONFIG_FILE=str(tree / "train_configs" / f"{config}.toml")),
        capture_output=True, text=True, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        raise SystemExit(f"{tree} {config}: exit {out.returncode}: " + " | ".join(tail))
    # the launch line of the run's log names the config file it read, absolute
    log = (dump / "bench" / "train.log").read_text(errors="replace")
    read = re.search(r"--job\.config_file (\S+)", log)
    if not read or not Path(read[1]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree} {config}: the run did not read its config from this tree "
                         f"({read[1] if read else 'no launch line in its train.log'})")
    times = {int(s): int(ms) for s, ms in _STEP.findall(out.stdout + out.stderr)}
    timed = [times[s] for s in sorted(times) if s > 2]
    if not timed:
        raise SystemExit(f"{tree} {config}: no step lines after step 2 in its output")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"step_ms": statistics.median(timed), "cpu_s": round(cpu, 2), "steps": len(timed)}


def compare(trees: dict[str, Path], configs: list[str], steps: int, rounds: int,
            threads: int, scratch: Path, overrides: list[str] = ()) -> list[dict]:
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(rounds):
        for config in configs:
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                got = run_once(trees[name], config, steps, threads, scratch / name, overrides)
                runs.setdefault((config, name), []).append(got)
                print(f"  round {r + 1} {config:28s} {name:6s} step {got['step_ms']:7.1f} ms"
                      f"  cpu {got['cpu_s']:7.1f} s", flush=True)
    rows = []
    for config in configs:
        row = {"config": config}
        for name in trees:
            got = runs[(config, name)]
            row[f"{name}_step_ms"] = statistics.median(g["step_ms"] for g in got)
            row[f"{name}_cpu_s"] = statistics.median(g["cpu_s"] for g in got)
        row["step_ratio"] = round(row["after_step_ms"] / row["before_step_ms"], 3)
        row["cpu_ratio"] = round(row["after_cpu_s"] / row["before_cpu_s"], 3)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| config | before step ms | after step ms | after/before | before cpu s | "
             "after cpu s | after/before |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['before_step_ms']:.0f} | {r['after_step_ms']:.0f} | "
                     f"{r['step_ratio']:.3f} | {r['before_cpu_s']:.1f} | {r['after_cpu_s']:.1f} | "
                     f"{r['cpu_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the git revision to compare against")
    p.add_argument("--configs", default="debug_model,speedrun_shakespeare_cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--overrides", default="", help="appended to every run of both trees")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    for c in configs:
        if not (REPO / "train_configs" / f"{c}.toml").is_file():
            p.error(f"--configs: train_configs/{c}.toml does not exist")
    if a.steps < 4:
        p.error("--steps: at least 4 (the first two steps are not timed)")
    scratch = Path(tempfile.mkdtemp(prefix="bench_revisions_"))
    before_tree, commit = Path(a.before), None
    if not (before_tree / "run_train.sh").is_file():
        rev = subprocess.run(["git", "rev-parse", "--verify", f"{a.before}^{{commit}}"],
                             cwd=REPO, capture_output=True, text=True)
        if rev.returncode != 0:
            shutil.rmtree(scratch)
            p.error(f"--before: {a.before!r} is neither a revision of {REPO} nor a checkout "
                    "folder holding run_train.sh")
        commit, before_tree = rev.stdout.strip(), scratch / "before_tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), commit],
                       cwd=REPO, check=True, capture_output=True)
    try:
        host = f"CPU {cpuinfo('model name') or 'unknown'} ({os.cpu_count()} cores)"
        print(f"machine: {host}; OMP_NUM_THREADS={a.threads}; before = {a.before}"
              f"{f' ({commit[:10]})' if commit else ''}, after = this tree", flush=True)
        trees = {"before": before_tree, "after": REPO}
        code = {name: imported_from(tree, a.threads) for name, tree in trees.items()}
        rows = compare(trees, configs, a.steps, a.rounds, a.threads, scratch,
                       shlex.split(a.overrides))
    finally:
        if commit:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)],
                           cwd=REPO, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(table(rows))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"machine": host, "threads": a.threads, "before": a.before,
                                      "before_commit": commit, "steps": a.steps,
                                      "rounds": a.rounds, "overrides": a.overrides,
                                      "code": code, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
