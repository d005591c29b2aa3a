"""Which step a Checkpointer resumes from (`Resume.pick`): the newest this run's folder holds
that every rank can load (falling back together, past the ones no resume takes), or
`checkpoint.load_step`; with none, the initial weights (`Resume.start`:
`checkpoint.initial_load_path`, a DCP step or with `initial_load_in_hf` a Hugging Face folder).
Restoring one step (open, fit, read, apply) is restore.py's.
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from torchllm.checkpoint.integrity import describe_failure
from torchllm.checkpoint.layout import WEIGHTS_ONLY, not_resumable
from torchllm.checkpoint.step import Step, read_marker, resolve_checkpoint
from torchllm.checkpoint.resume.restore import Restore
from torchllm.checkpoint.resume.retention import Retention
from torchllm.config.job_config import ConfigError
from torchllm.log import logger


class Resume:
    """Resumes a run: picks the step (agreed by every rank), `restore` restores it."""

    def __init__(self, ccfg, restore: Restore, retention: Retention, model,
                 loadable: list[str], has_optimizer: bool, load_hf=None):
        """`load_hf(model, folder, tokenizer_record)`: loads a Hugging Face folder's weights
        (checkpoint.initial_load_in_hf; torchllm.hf.load_initial_weights)."""
        self.cfg, self.restore, self.retention = ccfg, restore, retention
        self.folder, self.agree = retention.folder, retention.agree
        self.model, self.loadable, self.has_optimizer = model, loadable, has_optimizer
        self.load_hf = load_hf

    def pick(self) -> int | None:
        """Pick and restore the newest loadable checkpoint of this run: the step restored, None
        when its folder holds none (then `start` takes the initial weights). A checkpoint that fails to load on any rank is skipped on every rank with
        a warning naming the cause, for the one before it; if a specific `load_step` was asked
        for, its failure is an error, and newer checkpoints are moved aside (never deleted).
        """
        rank0 = self.agree.rank == 0
        scanned = self.agree.first_answer(self.folder.scan() if rank0 else None)
        steps = sorted(s for s, state in scanned.items() if state == "complete")
        self.retention.steps = self.retention.claim(steps)  # this run's, or refused
        if rank0:
            self._clean_partial(scanned)
        # What each marker says (rank 0 reads them; every rank gets the same answer).
        self.retention.not_resumable = self.agree.first_answer(
            self._classify(steps) if rank0 else None)
        load_step = self.cfg.load_step
        if load_step != -1:
            if load_step not in steps:
                raise ConfigError(
                    f"checkpoint.load_step = {load_step}: no complete checkpoint at that "
                    f"step in {self.folder}; available: {steps or 'none'}", "checkpoint.load_step",
                )
            if load_step in self.retention.not_resumable:
                self._weights_only_refusal([load_step], "checkpoint.load_step")
                logger.warning("checkpoint.load_step = %d: resuming from a checkpoint %s, as "
                               "asked", load_step, self.retention.not_resumable[load_step])
            error = None
            if self.agree.rank == 0:
                try:
                    moved, dest = self.folder.move_aside(load_step)
                except OSError as e:
                    error = f"could not move the newer checkpoints aside: {describe_failure(e)}"
                else:
                    if moved:
                        logger.warning(
                            "checkpoint.load_step = %d: moved the newer checkpoints %s to %s "
                            "(not deleted); this run continues from step %d, and a relaunch "
                            "without load_step resumes from its newest checkpoint", load_step,
                            moved, dest, load_step)
            if error := self.agree.one(self.agree.gather(error)):  # the others wait for the move
                raise RuntimeError(f"checkpoint.load_step = {load_step}: {error}")
            self.retention.steps = [s for s in steps if s <= load_step]
        candidates = [load_step] if load_step != -1 else self._candidates(steps)
        for step in reversed(candidates):
            path = self.folder.step_path(step)
            error = self.restore.restore(self.folder.step_store(step),
                                         self.cfg.exclude_from_loading, resume=True)
            if error is None:
                logger.info("resumed from %s (step %d)", path, step)
                self.restore.after_resume(path)
                self._set_aside(step)
                return step
            if load_step != -1:
                raise RuntimeError(f"checkpoint.load_step = {step}: {path} could not be "
                                   f"loaded: {error}")
            logger.warning("checkpoint %s could not be loaded (%s); trying an earlier one",
                           path, error)
        if steps:
            raise RuntimeError(f"none of the checkpoints {steps} in {self.folder} could be "
                               "loaded (causes in the warnings above)")
        return None

    def start(self) -> int | None:
        """A run with no step of its own: its initial weights (`initial_load_path`, a DCP step,
        or with `initial_load_in_hf` a Hugging Face folder): 0, or None (a fresh start)."""
        if self.cfg.initial_load_path and self.cfg.initial_load_in_hf:
            if self.load_hf is None:
                raise ConfigError("checkpoint.initial_load_in_hf: this program does not load "
                                  "Hugging Face folders (torchllm.train does)",
                                  "checkpoint.initial_load_in_hf")
            self.load_hf(self.model, self.cfg.initial_load_path,
                         self.restore.run_info.get("tokenizer"))
            logger.info("initialized from Hugging Face weights %s", self.cfg.initial_load_path)
            return 0
        if self.cfg.initial_load_path:
            path = resolve_checkpoint(self.cfg.initial_load_path)
            model_only = self.cfg.initial_load_model_only
            exclude = [k for k in self.loadable if k != "model"] if model_only else []
            error = self.restore.restore(path, exclude, resume=False)
            if error is not None:
                raise RuntimeError(f"checkpoint.initial_load_path: {path} could not be loaded: "
                                   f"{error}")
            logger.info("initialized from %s%s", path, " (model only)" if model_only else "")
            return 0
        return None

    def _classify(self, steps: list[int]) -> dict[int, str]:
        """Rank 0: {step: why it is no resume candidate} from the markers (layout.not_resumable;
        a marker written before they said so: weights only when it has no optimizer state).
        An unreadable marker is left to the load, which says why it cannot use it."""
        found = {}
        for step in steps:
            store = self.folder.step_store(step)
            try:
                record = read_marker(store)
                if "weights_only" not in record and "healthy" not in record and \
                        self.has_optimizer:
                    if "optimizer" not in Step.open(store).states:
                        record["weights_only"] = True
            except (Exception, CheckpointException):  # noqa: BLE001 - the load reports it
                continue
            if why := not_resumable(record):
                found[step] = why
        return found

    def _candidates(self, steps: list[int]) -> list[int]:
        """The steps a resume tries (newest last): the resume candidates (a seed checkpoint,
        weights at step 0, is a start); with none, the steps saved while the guard skipped
        updates; never weights-only ones (refused, naming initial_load_path). One warning
        names the newer steps passed over."""
        skip = self.retention.not_resumable
        good = [s for s in steps if s not in skip or s == 0]
        passed = [s for s in steps if s not in good and (not good or s > good[-1])]
        if good:
            if passed:
                logger.warning(
                    "not resuming from %s; trying step-%d, the newest checkpoint saved before "
                    "them with the full training state (the passed-over ones are moved aside once "
                    "it loads)", "; ".join(f"step-{s} ({skip[s]})" for s in reversed(passed)),
                    good[-1])
            return good
        unhealthy = [s for s in steps if skip.get(s) != WEIGHTS_ONLY]
        if unhealthy:
            logger.warning(
                "no checkpoint in %s was saved before updates were skipped: resuming from step-%d "
                "(%s) anyway; checkpoint.load_step picks another, --job.overwrite starts over",
                self.folder, unhealthy[-1], skip[unhealthy[-1]])
            return unhealthy
        self._weights_only_refusal(steps, "checkpoint.initial_load_path")
        return []

    def _weights_only_refusal(self, steps: list[int], key: str) -> None:
        """A ConfigError when one of `steps` (past step 0) holds weights only."""
        weights = [s for s in steps if s and self.retention.not_resumable.get(s) == WEIGHTS_ONLY]
        if weights:
            only = (f", and {self.folder} holds no full-state checkpoint"
                    if key == "checkpoint.initial_load_path" else "")
            raise ConfigError(
                f"checkpoint {self.folder.step_path(weights[-1])} holds weights only "
                "(checkpoint.last_save_model_only): it cannot resume a run (no optimizer, LR "
                f"schedule, data position or counters){only}; to train from these weights, "
                "start a new run (another job.run_name) with checkpoint.initial_load_path = "
                f"{self.folder.step_path(weights[-1])}", key)

    def _set_aside(self, step: int) -> None:
        """After resuming from `step`: move the newer steps no resume takes (weights only,
        saved while updates were skipped) aside, so that this run's saves never replace them
        and no later resume mixes them with this run's new steps."""
        newer = {s for s in self.retention.not_resumable if s > step}
        if not newer:
            return
        error = None
        if self.agree.rank == 0:
            try:
                moved, dest = self.folder.move_aside(step, only=newer)
                logger.warning("moved the checkpoints %s (never resumed from) to %s (not "
                               "deleted); this run continues from step %d", moved, dest, step)
            except OSError as e:
                error = f"could not move the newer checkpoints aside: {describe_failure(e)}"
        if error := self.agree.one(self.agree.gather(error)):
            raise RuntimeError(f"resuming from step {step}: {error}")
        self.retention.steps = [s for s in self.retention.steps if s not in newer]
        for s in newer:
            self.retention.not_resumable.pop(s)

    def _clean_partial(self, scanned: dict[int, str]) -> None:
        """Rank 0: warn about the steps that are never loaded, and delete the partial ones (a
        save or upload cut short: no marker, so nothing trusts them; on an object store they
        would linger and cost). Steps holding NaN/inf stay for inspection."""
        self.folder.warn_unusable(scanned)
        for step, state in sorted(scanned.items()):
            if state == "partial":
                try:
                    self.folder.delete(step)
                except OSError as e:
                    logger.warning("could not delete the incomplete checkpoint %s: %s",
                                   self.folder.step_path(step), describe_failure(e))

