"""The tests' commands `python -m MODULE args` and `python SCRIPT args`, run as Python runs them
but in a process forked from multiprocessing's fork server (conftest.preloaded_forkserver),
which imported torch and torchllm once: a command then starts in ~0.1 s instead of spending
~4 CPU-s (2-core machine) importing them again in a fresh interpreter.

    from preforked import run
    proc = run([sys.executable, "-m", "torchllm.train", ...], cwd=..., env=..., timeout=...,
               capture_output=True, text=True)      # subprocess.run's arguments and result

The forked process gets what the fresh one would: the environment (os.environ, torch's thread
count from OMP_NUM_THREADS), the working directory, sys.argv, sys.path (the command's folder
first, then PYTHONPATH), stdin (`input`) and stdout/stderr at file descriptors 0-2 (so output
written by C code or by a stream made before the fork lands there too), exit code from
SystemExit or 1 with the traceback printed for an uncaught exception, atexit handlers run at
the end. Its own session: a timeout kills everything it started.

Anything else runs as a fresh subprocess, unchanged: other programs (`./run_train.sh`, `bash`),
`python -c`, interpreter options, a PYTHONPATH naming another checkout (a fresh clone's code is
not the preloaded code), and every command when TORCHLLM_TEST_FRESH_PROCESSES=1 (the whole
suite through fresh interpreters: what this module saves, and a check that nothing depends on
it). The entry points themselves run as fresh processes in test_docs_commands.py and
test_fresh_clone.py, which never use this.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FRESH_ENV = "TORCHLLM_TEST_FRESH_PROCESSES"
PRELOADED_PATHS = {str(REPO), str(REPO / "tests")}  # what the fork server imports from


def forkable(argv: list, env: dict | None, cwd=None) -> bool:
    """Whether `argv` is `python -m MODULE ...` or `python SCRIPT.py ...` whose imports are the
    fork server's (see the module docstring)."""
    env = os.environ if env is None else env
    if "1" in (env.get(FRESH_ENV), os.environ.get(FRESH_ENV)) or len(argv) < 2:
        return False
    if str(argv[0]) != sys.executable:
        return False
    module = str(argv[1]) == "-m" and len(argv) > 2
    script = str(argv[1]).endswith(".py") and Path(cwd or ".", argv[1]).is_file()
    paths = {os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    return (module or script) and paths <= PRELOADED_PATHS


def run(argv: list, *, cwd=None, env: dict | None = None, input=None, timeout=None,
        capture_output: bool = False, text: bool = False, check: bool = False, stdout=None,
        stderr=None) -> subprocess.CompletedProcess:
    """subprocess.run(argv, ...) for the arguments above, forked where `forkable`."""
    kwargs = dict(cwd=cwd, env=env, input=input, timeout=timeout, capture_output=capture_output,
                  text=text, check=check, stdout=stdout, stderr=stderr)
    piped = capture_output or (stdout == subprocess.PIPE and stderr in (subprocess.PIPE,
                                                                        subprocess.STDOUT))
    if not (piped and forkable(argv, env, cwd)):
        return subprocess.run(argv, **{k: v for k, v in kwargs.items() if v is not None})
    import multiprocessing as mp

    from conftest import preloaded_forkserver

    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory(prefix="preforked-") as tmp:
        out_path, err_path, in_path = (os.path.join(tmp, n) for n in ("out", "err", "in"))
        merged = stderr == subprocess.STDOUT
        for path in (out_path, err_path):
            open(path, "wb").close()
        if input is not None:
            with open(in_path, "wb") as f:
                f.write(input.encode() if isinstance(input, str) else input)
        child = mp.get_context(preloaded_forkserver()).Process(
            target=_child, name=" ".join(argv[1:3]),
            args=(argv, os.path.abspath(cwd or os.getcwd()), dict(os.environ if env is None
                                                                  else env),
                  in_path if input is not None else os.devnull, out_path,
                  out_path if merged else err_path))
        child.start()
        child.join(timeout)
        timed_out = child.exitcode is None
        if timed_out:
            try:
                os.killpg(child.pid, signal.SIGKILL)  # (its session: see _child)
            except ProcessLookupError:
                child.kill()
            child.join()
        out, err = (Path(p).read_bytes() for p in (out_path, err_path))
    if text:
        out, err = out.decode(errors="replace"), err.decode(errors="replace")
    if merged:
        err = None
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, out, err)
    proc = subprocess.CompletedProcess(argv, child.exitcode, out, err)
    if check:
        proc.check_returncode()
    return proc


def _child(argv: list[str], cwd: str, env: dict, in_path: str, out_path: str,
           err_path: str) -> None:
    """In the forked process: become `python ARGV[1:]` started in `cwd` with `env`; never
    returns (os._exit with the command's exit code)."""
    import atexit
    import io

    import torch

    os.setsid()
    for fd, path in enumerate((in_path, out_path, err_path)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND if fd else os.O_RDONLY)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8")
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))  # (as `python -u`: no binary buffer)

    def writer(fd: int, **kw) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8",
                                write_through=unbuffered, **kw)

    sys.stdout = sys.__stdout__ = writer(1)
    sys.stderr = sys.__stderr__ = writer(2, errors="backslashreplace", line_buffering=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    omp = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0
                          else len(os.sched_getaffinity(0)))
    module = argv[1] == "-m"
    first = cwd if module else os.path.dirname(os.path.realpath(argv[1]))
    base = [p for p in sys.path if p.startswith((sys.base_prefix, sys.prefix))]
    sys.path[:] = [first, *[os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p], *base]
    code = run_as_main(argv[2], True, argv[3:]) if module else run_as_main(argv[1], False,
                                                                          argv[2:])
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def run_as_main(target: str, module: bool, argv: list[str]) -> int:
    """`python -m TARGET ARGV` (`module`) or `python TARGET ARGV` in this process, whose sys.path
    is set already: its exit code (SystemExit's; 1 for an uncaught exception, printed as Python
    prints it). Also what tests/forkrun.py's forked ranks run."""
    import runpy
    import traceback
    import warnings

    # `python -m M` finds M unimported; here a fork server may have imported it (runpy warns).
    warnings.filterwarnings("ignore", message=r".* found in sys\.modules after import of package",
                            category=RuntimeWarning)
    sys.argv = [target, *argv]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # as Python reports it: from the command's own frames on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_globals.get("__name__") != "__main__":
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        return 1
    return 0
