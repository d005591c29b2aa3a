"""What a training process does around its Trainer: logging, --help, dying with torchrun, the
exit code and the status file torchllm.run.launch reads (torchrun's own per-rank error file,
with the traceback, is torchelastic's @record). (The Trainer class is passed in: this
module sits below torchllm.train and never imports it.)"""

from __future__ import annotations

import os
import signal

from torch.distributed.elastic.multiprocessing.errors import record

from torchllm.config import ConfigError, help_text, load_config
from torchllm.run.failures import LAUNCHER_PID_ENV, exit_code, log_failure, write_status
from torchllm.log import close_run_log, init_logger, logger
from torchllm.parallel import destroy_distributed
from torchllm.run.runlock import release_held_locks, set_parent_death_signal


def trainer_from_args(trainer_cls, argv: list[str]):
    """A Trainer from CLI overrides, or None after logging a config error (exit code 2)."""
    try:
        return trainer_cls(load_config(argv))
    except ConfigError as e:
        logger.error("config error: %s", e)
        destroy_distributed()
        return None


def _release_locks_and_die(signum, frame) -> None:
    """SIGTERM outside training (torchrun stopping the ranks after one failed at start-up): free
    the run folder, then die of the signal as without this handler."""
    release_held_locks()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@record
def _build_and_train(trainer_cls, argv: list[str], built: list) -> None:
    """torchelastic's @record: an exception leaving here is written, with its traceback and a
    timestamp, to this rank's error file (torchrun's TORCHELASTIC_ERROR_FILE; nothing outside
    torchrun) before main() turns it into a log line, a status file and an exit code."""
    built.append(trainer_cls(load_config(argv)))
    built[0].train()


def main(trainer_cls, argv: list[str]) -> int:
    """Train; returns the exit code (torchllm.run.failures.exit_code: 0 done or stopped and saved,
    2 config error, 3 stopped by the loss guard, 130 interrupted, 1 any other error)."""
    init_logger(split_streams=True, argv=argv)  # stdout / stderr / RUN/train.log
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: die with it
        launcher = os.environ.get(LAUNCHER_PID_ENV)
        set_parent_death_signal(int(launcher) if launcher else None)
    built, error = [], None  # the Trainer, once built
    # Training replaces this handler with its own (stop after the step, save, exit 0).
    previous = signal.signal(signal.SIGTERM, _release_locks_and_die)
    try:
        _build_and_train(trainer_cls, argv, built)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - logged, then an exit code
        error = e
        log_failure(e, built[0].step if built else 0)
    finally:
        code = exit_code(error)
        # For torchllm.run.launch, which prints the first error once; written before leaving the
        # process group, which makes the other ranks fail too.
        write_status(code, error)
        destroy_distributed()
        # The lock is released here, not by atexit: the process ends with os._exit. A Trainer
        # that failed half-built (a checkpoint that cannot load) is not even returned to us.
        release_held_locks()
        signal.signal(signal.SIGTERM, previous)
        close_run_log()
    return code
