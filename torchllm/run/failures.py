"""How a worker's end reaches the launcher: torchelastic's records, and one small status file per
rank for what they lack.

torchelastic's part: `@record` (on the worker's build-and-train, in `torchllm.run.process`)
writes torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE: the exception, its full
traceback, a timestamp in seconds) and turns on faulthandler; torchrun reads it into
`ChildFailedError`, whose failures name each rank it saw end with its exit code or signal (a
rank killed from outside: `signal SIGKILL`). The launcher names a rank that died without a word
from those records.

What those records lack, and this module keeps:
- clean exits: after SIGTERM, torchrun's SignalException says nothing of the workers; a status
  file per rank (code 0) tells the launcher that every rank saved and exited cleanly;
- the root cause: whether an error is an echo of another rank's death (a collective failing on
  a closed connection) and its time to the microsecond (error files carry seconds; torchrun's
  failures hold only the ranks that ended in the same poll), so the first real error is shown;
- the exit code per kind of stop (2 config error, 3 loss guard, 4 checkpoint not saved) with a
  one-line summary and the innermost torchllm source line: the launcher's one-line report.

`python -m torchllm.run` (what run_train.sh runs) exports TORCHLLM_STATUS_DIR to its
workers. Each worker's `main()` writes `rank<R>.json` there as it ends: its exit code and, for a
failure, a one-line summary of the exception, the innermost source line and the time. The
launcher reads them after torchrun returns, so the first error (the root cause; later ones on
other ranks are usually its echo) is printed once, on the launcher's console, whatever
LOG_RANK shows. Without the variable (plain torchrun, tests) nothing is written.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from torchllm.checkpoint import CheckpointSaveError
from torchllm.config import ConfigError
from torchllm.log import file_only, logger
from torchllm.metrics import TrainingStopped
from torchllm.ranks import env_rank

STATUS_DIR_ENV = "TORCHLLM_STATUS_DIR"
LAUNCHER_PID_ENV = "TORCHLLM_LAUNCHER_PID"


def summary(exc: BaseException) -> str:
    """'Type: first line of the message' (config errors: the message, which says it all)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(exc, ConfigError):
        return f"config error: {text}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def where(exc: BaseException) -> str:
    """The innermost frame of `exc` in torchllm's code (else the innermost) as 'path:line in f'."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if f"{os.sep}torchllm{os.sep}" in f.filename]
    f = (ours or frames)[-1]
    path = f.filename
    if ours:
        path = path[path.rindex(f"{os.sep}torchllm{os.sep}") + 1:]
    return f"{path}:{f.lineno} in {f.name}"


# What a rank sees when another rank died under it (gloo, NCCL, the TCP store).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "failed to recv", "Socket Timeout")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank is gone (an echo)."""
    return any(s in str(exc) for s in _PEER_GONE)


def exit_code(exc: BaseException | None) -> int:
    """0 done (or stopped by a signal/limit and saved), 2 config error, 3 stopped by the loss
    guard, 4 a checkpoint could not be saved, 130 interrupted (a second Ctrl-C), 1 any other."""
    if exc is None:
        return 0
    if isinstance(exc, ConfigError):
        return 2
    if isinstance(exc, TrainingStopped):
        return 3
    if isinstance(exc, CheckpointSaveError):
        return 4
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def log_failure(exc: BaseException, step: int) -> None:
    """This rank's console: one line for expected stops, the traceback for real errors."""
    if isinstance(exc, ConfigError):
        if os.environ.get(STATUS_DIR_ENV):  # torchllm.run.launch prints it, once
            file_only(f"config error: {exc}")
        else:
            logger.error("config error: %s", exc)
    elif isinstance(exc, TrainingStopped):
        logger.error("training stopped by the guard: %s", exc)
    elif isinstance(exc, CheckpointSaveError):  # already one line: folder, cause, bytes
        logger.error("%s", exc)
    elif isinstance(exc, KeyboardInterrupt):
        logger.warning("interrupted at step %d; stopping", step)
    elif is_peer_failure(exc):  # an echo of another rank's failure: no second traceback
        logger.error("stopped at step %d: another rank is gone (%s)", step, summary(exc))
    else:
        logger.exception("failed at step %d", step)


def write_status(code: int, exc: BaseException | None = None) -> None:
    """Record this rank's exit for the launcher (a no-op outside `torchllm.run.launch`)."""
    folder = os.environ.get(STATUS_DIR_ENV)
    if not folder:
        return
    rank = env_rank()
    status = {"rank": rank, "code": code, "time": time.time()}
    if exc is not None:
        status.update(error=summary(exc), where=where(exc), echo=is_peer_failure(exc))
    path = Path(folder) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(status))
        os.replace(tmp, path)
    except OSError:
        pass  # the launcher is gone or its folder too: nothing to report to


def read_statuses(folder: str | Path) -> list[dict]:
    """Every rank's status in `folder`, sorted by rank."""
    out = []
    for path in Path(folder).glob("rank*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda s: s["rank"])


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def failure_report(statuses: list[dict], failed_ranks: dict[int, str],
                   error_files: dict[int, str] | None = None) -> tuple[list[str], int]:
    """(lines to print, exit code) for a failed launch.

    `failed_ranks`: rank -> how torchrun saw it end (e.g. 'exit code 1', 'signal SIGTERM'),
    for the ranks that left no status file (killed, or crashed in the interpreter).
    `error_files`: rank -> torchrun's error file (@record's traceback) where it is kept
    (torchrun's --log-dir, run_train.sh's LOG_DIR); else the line points at LOG_RANK.
    """
    # The root cause: the first error that is not a rank losing its peers.
    errors = sorted((s for s in statuses if s.get("code", 0) != 0 and s.get("error")),
                    key=lambda s: (s.get("echo", False), s["time"]))
    lines: list[str] = []
    if not errors:
        ended = "; ".join(f"rank {r}: {how}" for r, how in sorted(failed_ranks.items()))
        ranks = ",".join(str(r) for r in sorted(failed_ranks)) or "0"
        return [f"training failed before any rank reported an error ({ended}); LOG_RANK={ranks} "
                "shows those ranks' output"], 1
    first = errors[0]
    reported = {s["rank"] for s in statuses}
    silent = sorted(r for r in failed_ranks if r not in reported)
    if first.get("echo"):  # every reported error is a rank losing its peers
        lost = _ranks(sorted(s["rank"] for s in errors))
        if silent:  # a rank that died without a word is the root cause
            ended = "; ".join(f"rank {r}: {failed_ranks[r]}" for r in silent)
            return [f"{_ranks(silent)} died without reporting an error ({ended}); "
                    f"LOG_RANK={','.join(map(str, silent))} shows its console",
                    f"  then {lost} stopped because of it ({first['error']})"], 1
        return [f"{lost} lost the connection to each other and none reported an error of its "
                f"own ({first['error']}): a process was killed from outside (OOM killer, "
                "scheduler) or the network between them failed"], 1
    same = [s["rank"] for s in errors if s["error"] == first["error"]]
    lines.append(f"{_ranks(same)} failed: {first['error']}")
    if first.get("where") and not first["error"].startswith("config error:"):
        kept = (error_files or {}).get(first["rank"])
        lines.append(f"  at {first['where']} (traceback: "
                     + (kept if kept else f"LOG_RANK={first['rank']} shows that rank's console")
                     + ")")
    echoes = [s["rank"] for s in errors if s["error"] != first["error"]]
    echoes += silent
    if echoes:
        lines.append(f"  then {_ranks(sorted(echoes))} stopped because of it")
    return lines, first["code"]
