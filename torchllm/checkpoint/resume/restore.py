"""Restoring one step into a Checkpointer's states on every rank, or on none, and saying why a
step did not load (which rank, file, key or shape).

open -> fit -> read -> apply, in three agreed phases, so no rank is ever left inside a
collective alone: rank-local checks (the step opened once, checksums, the fit checks features
register: fit.py) -> DCP's read through the reader (which itself raises on every rank when one
fails) -> applying the states (rank-local again). A step that cannot fit this config (a ConfigError on any rank) stops every rank; any
other problem is returned, so the resume can fall back to an earlier step.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from torchllm.checkpoint.index import untrusted_cause
from torchllm.checkpoint.integrity import check_files, describe_failure
from torchllm.checkpoint.layout import step_of
from torchllm.checkpoint.resume.agree import RankAgreement
from torchllm.checkpoint.resume.fit import Fit, run_checks
from torchllm.checkpoint.resume.hparams import apply_hparams, config_changes, current_lr
from torchllm.checkpoint.step import Step
from torchllm.config.job_config import ConfigError
from torchllm.log import logger
from torchllm.storage import Location
from torchllm.store import Store


class Restore:
    """Restores a step into `states` (key -> object with load_state_dict(); this rank's data
    loader and RNG states are under `dataloader_key` and `rng_key`). `hparams`: the configured
    optimizer hyperparameters (checkpoint.optimizer_hparams_from = 'config' puts them back)."""

    def __init__(self, ccfg, states: dict[str, Any], dataloader_key: str, rng_key: str,
                 agree: RankAgreement, optimizer=None, lr_scheduler=None,
                 hparams: list[dict] | None = None, run_info: dict | None = None):
        self.cfg, self.states, self.agree = ccfg, states, agree
        self.dataloader_key, self.rng_key = dataloader_key, rng_key
        self.optimizer, self.lr_scheduler, self.hparams = optimizer, lr_scheduler, hparams
        self.run_info = run_info or {}
        self.opened: Step | None = None  # the step `restore` opened last
        # Saved states read into another key's object: a rank the checkpoint has no data
        # position for (more data-parallel ranks than it was saved with) reads rank 0's, and
        # the loader continues the global batch order from it (data/loader.py).
        self.read_as: dict[str, str] = {}

    def restore(self, path: Location | Store, exclude: list[str], resume: bool) -> str | None:
        """Restore `path` on every rank, or none: the cause (one line, every rank's) if any rank
        cannot. Raises ConfigError on every rank when the checkpoint cannot fit this config."""
        # 1. Open and fit (rank-local, before any collective): the step opened once (marker,
        # index checked against its files), checksums (each rank a share of the files), and
        # the registered fit checks (fit.py: batch, data, vocabulary, LoRA, family).
        fit, problem, misfit = None, None, None
        try:
            step = self.opened = Step.open(path)
            if self.cfg.checksums:
                problem = check_files(step.store, step.marker, self.agree.rank, self.agree.world)
            if problem is None:
                fit = self._fit(step, exclude, resume)
        except ConfigError as e:
            misfit = str(e)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - unreadable
            problem = describe_failure(e)
        if problem := self._agreed(misfit, problem):
            return problem
        # 2. Read (DCP gathers every rank's read errors and raises on all of them).
        try:
            step.read(fit.states)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            problem, misfit = describe_failure(e), untrusted_cause(e)  # code in it: stop
        if problem := self._agreed(misfit, problem):
            return problem
        # 3. Apply (rank-local: a failure here is agreed on like the others; a ConfigError,
        # e.g. the data loader refusing another data-parallel degree, stops every rank).
        try:
            for action in fit.on_apply:
                action(fit.states)
            for key, sd in fit.states.items():
                self.states[self.read_as.get(key, key)].load_state_dict(sd)
        except ConfigError as e:
            misfit = str(e)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            problem = describe_failure(e)
        return self._agreed(misfit, problem)

    def _fit(self, step: Step, exclude: list[str], resume: bool) -> Fit:
        """The registered checks (fit.py) on `step`, and the state dicts to read into;
        ConfigError when it cannot fit this config."""
        fit = Fit(step, self.cfg, self.run_info, resume, list(exclude))
        run_checks(fit, "marker")
        fit.states = {k: s.state_dict()
                      for k, s in self._wanted(fit.where, step.states, fit.exclude).items()}
        run_checks(fit, "states")
        return fit

    def _agreed(self, misfit: str | None, problem: str | None) -> str | None:
        """Every rank's outcome: a ConfigError on every rank if any rank found the checkpoint
        cannot fit this config, else every rank's problem as one line (None: all loaded)."""
        outcomes = self.agree.gather((misfit, problem))
        if misfit := self.agree.one([m for m, _ in outcomes]):
            raise ConfigError(misfit, "checkpoint")
        return self.agree.one([p for _, p in outcomes])

    def after_resume(self, path: Location) -> None:
        """One warning listing the config changes since `path` was saved, and what wins."""
        saved, now = self.opened.config_text, self.run_info.get("config_toml")
        if now and saved:
            changes = config_changes(saved, now, self.cfg.optimizer_hparams_from)
            if changes:
                logger.warning("resuming with %d config change(s) since %s/config.toml: %s",
                               len(changes), path, "; ".join(changes))
        if self.cfg.optimizer_hparams_from == "config" and self.hparams is not None:
            apply_hparams(self.optimizer, self.lr_scheduler, self.hparams)
            logger.info("optimizer hyperparameters (peak LR, betas, eps, weight decay) taken "
                        "from the config (checkpoint.optimizer_hparams_from = 'config')")
        elif self.optimizer is not None and self.lr_scheduler is not None and \
                hasattr(self.lr_scheduler, "lr_lambdas"):
            current_lr(self.optimizer, self.lr_scheduler)

    def _wanted(self, path: str, present: set[str], exclude: list[str]) -> dict[str, Any]:
        wanted = {}
        for key, state in self.states.items():
            kind = "dataloader" if key == self.dataloader_key else "rng" if key == self.rng_key else key
            if kind in exclude:
                if kind == "dataloader" and "dataloader" in self.cfg.exclude_from_loading:
                    logger.warning(
                        "not loading the data position of %s (checkpoint.exclude_from_loading): "
                        "the data order restarts from its first batch, so the %s global batches "
                        "trained before it are read again", path, step_of(path) or "")
                continue
            if key in present:
                wanted[key] = state
            elif kind == "model":
                raise ConfigError(f"checkpoint {path} holds no model weights")
            elif kind == "dataloader" and "dataloader_dp0" in present:
                # Saved with fewer data-parallel ranks: every rank's position counts the same
                # batches, so rank 0's places this rank in the same global batch order.
                wanted["dataloader_dp0"] = state
                self.read_as["dataloader_dp0"] = key
            elif kind != "rng":
                logger.warning("checkpoint %s has no %s state; it starts fresh", path, kind)
        return wanted
