"""Which of a run's complete steps are kept: the steps a Checkpointer knows (listed once per
launch, then kept up to date by its own saves and deletions), the ones no resume takes, and
`checkpoint.keep_latest_k`.

Retention counts only resume candidates, and never deletes the newest one for steps no resume
would take (weights only; saved while the loss guard skipped updates)."""

from __future__ import annotations

from torchllm.checkpoint.resume.agree import RankAgreement
from torchllm.checkpoint.identity import foreign
from torchllm.checkpoint.integrity import describe_failure
from torchllm.checkpoint.layout import StepFolders, as_folders, not_resumable
from torchllm.config.job_config import ConfigError
from torchllm.log import logger
from torchllm.storage import Location


class Retention:
    """The known complete steps of `folder` (`steps`, oldest first; None until listed) and
    why some are no resume candidates (`not_resumable`); rank 0 deletes, every rank agrees.
    `folder` is bound once (layout.StepFolders); the saver and the resume use this one."""

    def __init__(self, folder: Location | StepFolders, keep_latest_k: int, agree: RankAgreement,
                 run_id: str | None = None):
        self.folder: StepFolders = as_folders(folder)
        self.keep_latest_k, self.agree = keep_latest_k, agree
        self.run_id = run_id  # this run's (identity.py): another run's steps are never touched
        self.steps: list[int] | None = None  # complete steps: listed once, then kept here
        self.not_resumable: dict[int, str] = {}  # complete steps no resume takes: why

    def known(self, agree: bool = True) -> list[int]:
        """This run's complete steps, oldest first: listed once per launch (rank 0's listing,
        on every rank), then kept up to date by this Checkpointer's own saves and deletions
        (an object store's listing is slow, and a run lock keeps other writers out)."""
        if self.steps is None:
            rank0 = self.agree.rank == 0
            steps = self.folder.complete() if rank0 or not agree else None
            steps = self.claim(steps, agree)
            self.steps = sorted(steps)
        return self.steps

    def claim(self, steps: list[int] | None, agree: bool = True) -> list[int]:
        """`steps` (rank 0's listing; every rank gets it when `agree`), after checking that
        they are this run's: a ConfigError on every rank naming the folder and the other run
        when they are not (identity.foreign), before anything is loaded, written or deleted."""
        asks = steps is not None and (self.agree.rank == 0 or not agree)
        problem = foreign(self.folder, steps, self.run_id) if asks else None
        if agree:
            steps, problem = self.agree.first_answer((steps, problem))
        if problem:
            raise ConfigError(problem, "checkpoint.folder")
        return steps

    def clear(self) -> None:
        """`--job.overwrite` on object storage (run/rundir.py deletes a local checkpoint folder
        itself): rank 0 deletes every step of the folder, complete or not, once the complete
        ones are known to be this run's (identity.foreign: else nothing is deleted, and every
        rank raises a ConfigError naming the other run); then no rank knows of any step."""
        steps = self.folder.scan() if self.agree.rank == 0 else {}
        complete = sorted(s for s, state in steps.items() if state == "complete")
        problem = foreign(self.folder, complete, self.run_id)
        if not problem and steps:
            for step in sorted(steps):
                self.folder.delete(step)  # the marker first
            logger.warning("job.overwrite: deleted this run's previous checkpoints: %s (%d "
                           "step(s): %s)", self.folder, len(steps), sorted(steps))
        if problem := self.agree.first_answer(problem):
            raise ConfigError(f"job.overwrite: {problem}", "checkpoint.folder")
        self.steps = []

    def add(self, step: int, kind: dict | None, agree: bool = True) -> None:
        """A step just committed: known, flagged when it is no resume candidate, retention."""
        self.known(agree).append(step)
        why = not_resumable(kind or {})
        if why:
            self.not_resumable[step] = why
        self.purge()

    def forget(self, step: int) -> None:
        if self.steps is not None and step in self.steps:
            self.steps.remove(step)
        self.not_resumable.pop(step, None)

    def newest_good(self) -> int | None:
        """The newest known step a resume takes."""
        good = [s for s in self.known() if s not in self.not_resumable]
        return good[-1] if good else None

    def purge(self) -> None:
        """Retention (every rank updates its list; rank 0 deletes): keeps the newest K resume
        candidates, and the newest K other complete steps (weights only, saved while updates
        were skipped) newer than the newest candidate; deletes the other complete ones. So the
        last good checkpoint is never deleted for steps no resume would take."""
        k = self.keep_latest_k
        if k <= 0:
            return
        known = sorted(self.known())
        good = [s for s in known if s not in self.not_resumable]
        newest = good[-1] if good else -1
        keep = set(good[-k:]) | set([s for s in known if s in self.not_resumable
                                     and s > newest][-k:])
        for old in [s for s in known if s not in keep]:
            self.forget(old)
            if self.agree.rank != 0:
                continue
            path = self.folder.step_path(old)
            try:
                self.folder.delete(old)  # the marker first: never partly deleted yet complete
            except Exception as e:  # noqa: BLE001 - any store error, not only OSError
                logger.warning("retention (checkpoint.keep_latest_k = %d) could not delete %s: "
                               "%s; it stays on disk, delete it by hand", k, path,
                               describe_failure(e))
