"""torchrun with forked workers, for the tests' multi-rank launches:

    python tests/forkrun.py [torchrun options] SCRIPT [args ...]
    python tests/forkrun.py [torchrun options] -m MODULE [args ...]

is `python -m torch.distributed.run` with the same options and torch's own agent (rendezvous,
worker environment, `[rankN]:` prefixes, error files, exit codes), set up the way run_train.sh's
launcher sets it up (torchllm.run.launch: a single-node rendezvous on 127.0.0.1 with a random
id), whose workers are forked from this process as a CPU `./run_train.sh` forks them
(torchllm.run.launch.run_forked) instead of each being a fresh `python -u SCRIPT`: torch and
torchllm are imported here once, not once per rank (~4 CPU-s a rank on a 2-core machine). Each
worker runs SCRIPT (or MODULE) as `__main__` with its arguments, as Python would (the product's
`python -m torchllm.run.forked` runs a module's main(args) instead; the tests' workers are
scripts).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys


def _return_from_worker(code: int):
    # torchllm.run.process_exit.exit_process ends a fresh process with os._exit; a forked worker
    # must instead return to torch's wrapper, which hands its result to the agent and then ends
    # the process with os._exit itself (no interpreter finalization either way).
    raise SystemExit(code)


def run_worker(target: str, module: bool, argv: list[str]) -> int:
    """`python -u TARGET ARGV` (or `-m TARGET`) in this forked worker: its exit code."""
    from preforked import run_as_main  # (this file's folder: sys.path[0])
    from torchllm.run import process_exit

    process_exit.exit_process = _return_from_worker  # (before the script imports it)
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    return run_as_main(target, module, argv)


def main() -> None:
    import torch
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args

    from torchllm.run.launch import torchrun_forked

    args = parse_args(sys.argv[1:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (one thread until the fork: torchllm.run.launch._forked_worker)
    importlib.import_module("torchllm.train")  # what the workers run: once, before the fork
    torch.set_num_threads(threads)
    run = functools.partial(run_worker, args.training_script, args.module)
    record(torchrun_forked)(sys.argv[1:], run)


if __name__ == "__main__":
    main()
