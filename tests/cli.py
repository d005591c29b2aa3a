"""What users type, run by the tests: in this process (most tests) or as the real command (the
`e2e` tier).

    run_train(*overrides, config=..., env=...)   # ./run_train.sh with NGPU=1
    run_module("torchllm.eval.loss", *args)     # python -m torchllm.eval.loss ARGS
    run_script("benchmarks/x.py", *args)        # python benchmarks/x.py ARGS
    run_train(..., process=True)                 # the same, as a new process (e2e tests)

In this process, `run_train` calls what `./run_train.sh` execs, `torchllm.run.launch.main`, with
run_train.sh's own launcher options: the config check before any rank starts, the run lock, and
(one process) the Trainer in the launcher's process, as NGPU=1 trains. `run_module` calls the
module's `main(argv)`, which its `__main__` block (`exit_process(main())`) calls; `run_script`
runs the file as `__main__` (runpy), its folder first on sys.path as Python puts it. What is left
out is the interpreter start: ~4 CPU-s of imports a launch. The console is captured (stdout,
stderr: the torchllm logger's handlers are made on them; `stdin` is the input), `env` is set
for the call only, the working directory is the repository root (run_train.sh's `cd`) or
`cwd`, and the process state a run changes (logging handlers, thread count, environment, argv,
stdin) is put back afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEBUG_CONFIG = "./train_configs/debug_model.toml"
# run_train.sh's launcher options for one node, NGPU=1, LOG_RANK=0.
LAUNCH = ["--nproc_per_node=1", "--nnodes=1", "--local-ranks-filter=0", "--role=rank", "--tee=3",
          "--standalone"]


@dataclasses.dataclass
class Ran:
    """A command's exit code and console (subprocess.CompletedProcess's names)."""
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        return self.stdout + self.stderr


class _Console(io.StringIO):
    """A captured stream whose fileno is the real one's (faulthandler, enabled by torchelastic's
    @record, writes a crash's traceback there)."""

    def __init__(self, real):
        super().__init__()
        self._real = real

    def fileno(self) -> int:
        return self._real.fileno()


@contextlib.contextmanager
def _as_a_process(argv0: str, args: list[str], env: dict | None, cwd: str | Path | None = None,
                  stdin: str | None = None):
    """Captured console (`stdin`, if given: the text read from standard input); env,
    cwd, argv, stdin, logging, threads and signals put back afterwards."""
    import signal

    saved_env = dict(os.environ)
    saved_cwd, saved_argv, saved_stdin = os.getcwd(), sys.argv, sys.stdin
    saved_threads = torch.get_num_threads()
    saved_sigterm, saved_sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    loggers = [logging.getLogger(n) for n in ("", "torch", "torchllm")]
    saved_logging = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    out, err = _Console(sys.__stdout__), _Console(sys.__stderr__)
    # A fresh process's root logger has no handler: a warning no handler takes is printed on
    # stderr (logging.lastResort). Under pytest the root logger has pytest's, so say it here too.
    last_resort = logging.StreamHandler(err)
    last_resort.setLevel(logging.WARNING)
    loggers[0].addHandler(last_resort)
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    os.chdir(REPO if cwd is None else cwd)
    sys.argv = [argv0, *args]
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    finally:
        from torchllm.log import close_run_log

        close_run_log()
        for lg, handlers, level, propagate in saved_logging:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
        sys.argv, sys.stdin = saved_argv, saved_stdin
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)
        signal.signal(signal.SIGTERM, saved_sigterm)
        signal.signal(signal.SIGINT, saved_sigint)


def _called(argv0: str, main, args: list[str], env: dict | None, cwd=None, stdin=None) -> Ran:
    with _as_a_process(argv0, args, env, cwd, stdin) as (out, err):
        try:
            code = main(args)
        except SystemExit as e:  # argparse's --help / usage errors
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Ran([argv0, *args], 0 if code is None else int(code), out.getvalue(), err.getvalue())


def _spawned(cmd: list[str], env: dict | None, timeout: float, cwd=None, stdin=None) -> Ran:
    where = REPO if cwd is None else Path(cwd)
    full_env = {**os.environ, "PYTHONPATH": str(where), **{k: str(v) for k, v in
                                                            (env or {}).items()}}
    p = subprocess.run(cmd, cwd=where, env=full_env, capture_output=True, text=True,
                       timeout=timeout, input=stdin)
    return Ran(cmd, p.returncode, p.stdout, p.stderr)


def run_train(*overrides: str, config: str | Path = DEBUG_CONFIG, env: dict | None = None,
              process: bool = False, timeout: float = 600, cwd: str | Path | None = None,
              stdin: str | None = None) -> Ran:
    """`CONFIG_FILE=config ./run_train.sh OVERRIDES` with NGPU=1 (in this process unless
    `process`: then the script itself), from `cwd` (default: this checkout; a copy of it, e.g. a
    fresh clone: relative paths, the config and outputs/ resolve there), `stdin` its input."""
    if process:
        return _spawned(["./run_train.sh", *overrides],
                        {"CONFIG_FILE": str(config), "NGPU": "1", **(env or {})}, timeout, cwd,
                        stdin)
    from torchllm.run import launch

    args = [*LAUNCH, "--", "--job.config_file", str(config), *overrides]
    return _called("torchllm/run/__main__.py", launch.main, args, env, cwd, stdin)


def run_module(module: str, *args: str, env: dict | None = None, process: bool = False,
               timeout: float = 600, cwd: str | Path | None = None,
               stdin: str | None = None) -> Ran:
    """`python -m MODULE ARGS` (in this process unless `process`), from `cwd` (default: this
    checkout), `stdin` its input."""
    if process:
        return _spawned([sys.executable, "-m", module, *args], env, timeout, cwd, stdin)
    mod = importlib.import_module(module)
    if not hasattr(mod, "main"):  # a package: its __main__ module calls main()
        mod = importlib.import_module(f"{module}.__main__")
    return _called(mod.__file__, mod.main, list(args), env, cwd, stdin)


def run_script(script: str | Path, *args: str, env: dict | None = None, process: bool = False,
               timeout: float = 600, cwd: str | Path | None = None,
               stdin: str | None = None) -> Ran:
    """`python SCRIPT ARGS` (in this process unless `process`), from `cwd` (default: this
    checkout), `stdin` its input. sys.path and the modules the script imports from its own
    folder (e.g. benchmarks/benchlib) are put back afterwards, as a process would leave them."""
    if process:
        return _spawned([sys.executable, str(script), *args], env, timeout, cwd, stdin)
    path = (REPO if cwd is None else Path(cwd)) / script
    folder = str(path.parent.resolve())

    def main(argv: list[str]) -> int:
        before, saved_path = set(sys.modules), list(sys.path)
        sys.path.insert(0, folder)
        try:
            runpy.run_path(str(path), run_name="__main__")
        finally:
            sys.path[:] = saved_path  # (a script may add folders of its own)
            for name in set(sys.modules) - before:
                if (getattr(sys.modules[name], "__file__", None) or "").startswith(folder):
                    del sys.modules[name]
        return 0

    return _called(str(script), main, list(args), env, cwd, stdin)
