"""torchrun with forked CPU workers, for launchers of modules other than the trainer:

    python -m torchllm.run.forked [torchrun options] -m MODULE [args ...]

is `torchrun [torchrun options] -m MODULE [args ...]` for a MODULE whose `main(args)` returns
an exit code (what `python -m MODULE` runs), with the workers forked from this process as a CPU
`./run_train.sh` forks them (torchllm.run.launch): MODULE, torch and torchllm are imported
here once, so a worker starts in ~0.1 s instead of importing them again (~4 CPU-s a rank on a
2-core machine), and a single-node rendezvous listens on 127.0.0.1 with a random id. CPU only:
CUDA does not survive a fork (use torchrun there). benchmarks/bench_parallel.py launches its
CPU variants with it.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args

    from torchllm.run.launch import torchrun_forked

    argv = list(sys.argv[1:] if argv is None else argv)
    if not parse_args(argv).module:
        sys.exit("python -m torchllm.run.forked: name the workers' module with -m MODULE "
                 "(its main(args) runs in each forked worker); for a script use torchrun")
    record(torchrun_forked)(argv)


if __name__ == "__main__":
    main()
