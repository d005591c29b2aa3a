"""Loading for the Checkpointer: pick the newest checkpoint every rank can load, fall back
together, and say why a checkpoint did not load (which rank, file, key or shape).

Loading happens in three agreed phases, so no rank is ever left inside a collective alone:
rank-local checks (checksums, keys and shapes, batch size) -> DCP's read (which itself raises
on every rank when one fails) -> applying the states (rank-local again).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchllm.checkpoint.integrity import check_files, describe_failure, structure_mismatch
from torchllm.checkpoint.layout import (
    WEIGHTS_ONLY,
    delete_step,
    move_aside,
    not_resumable,
    read_marker,
    resolve_checkpoint,
    scan_steps,
    step_dir,
    warn_unusable,
)
from torchllm.checkpoint.resume import apply_hparams, config_changes, current_lr
from torchllm.checkpoint.safe_load import untrusted_cause
from torchllm.checkpoint.storage import Location, join, storage_for
from torchllm.checkpoint.vocab_resize import full_templates, grow_rows, place, plan_growth
from torchllm.config.job_config import ConfigError
from torchllm.data.fingerprint import changes as data_changes
from torchllm.log import logger
from torchllm.models.lora import checkpoint_misfit, fresh_adapters


class LoadingMixin:
    """The loading half of `Checkpointer` (which provides cfg, states, _gather and _one)."""

    def load(self) -> int | None:
        """Restore the newest loadable checkpoint of this run (or `initial_load_path`).

        Returns the step restored from this run's folder, 0 for initial weights, None for a
        fresh start. A checkpoint that fails to load on any rank is skipped on every rank with
        a warning naming the cause, for the one before it; if a specific `load_step` was asked
        for, its failure is an error, and newer checkpoints are moved aside (never deleted).
        """
        scanned = self._gather(scan_steps(self.folder) if self.rank == 0 else None)[0]
        steps = self.steps = sorted(s for s, state in scanned.items() if state == "complete")
        if self.rank == 0:
            self._clean_partial(scanned)
        # What each marker says (rank 0 reads them; every rank gets the same answer).
        self.not_resumable = self._gather(self._classify(steps) if self.rank == 0 else None)[0]
        load_step = self.cfg.load_step
        if load_step != -1:
            if load_step not in steps:
                raise ConfigError(
                    f"checkpoint.load_step = {load_step}: no complete checkpoint at that "
                    f"step in {self.folder}; available: {steps or 'none'}", "checkpoint.load_step",
                )
            if load_step in self.not_resumable:
                self._weights_only_refusal([load_step], "checkpoint.load_step")
                logger.warning("checkpoint.load_step = %d: resuming from a checkpoint %s, as "
                               "asked", load_step, self.not_resumable[load_step])
            error = None
            if self.rank == 0:
                try:
                    moved, dest = move_aside(self.folder, load_step)
                except OSError as e:
                    error = f"could not move the newer checkpoints aside: {describe_failure(e)}"
                else:
                    if moved:
                        logger.warning(
                            "checkpoint.load_step = %d: moved the newer checkpoints %s to %s "
                            "(not deleted); this run continues from step %d, and a relaunch "
                            "without load_step resumes from its newest checkpoint", load_step,
                            moved, dest, load_step)
            if error := self._one(self._gather(error)):  # the others wait for the move
                raise RuntimeError(f"checkpoint.load_step = {load_step}: {error}")
            self.steps = [s for s in steps if s <= load_step]
        candidates = [load_step] if load_step != -1 else self._candidates(steps)
        for step in reversed(candidates):
            path = step_dir(self.folder, step)
            error = self._try_load(path, self.cfg.exclude_from_loading, resume=True)
            if error is None:
                logger.info("resumed from %s (step %d)", path, step)
                self._after_resume(path)
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
        if self.cfg.initial_load_path and self.cfg.initial_load_in_hf:
            from torchllm.checkpoint.hf import load_hf_weights
            from torchllm.checkpoint.tokenizer_identity import check_same_tokenizer, hf_record

            folder = self.cfg.initial_load_path
            check_same_tokenizer(hf_record(folder), self.run_info.get("tokenizer"),
                                 f"the Hugging Face folder {folder}", "initial load")
            load_hf_weights(self.model, self.cfg.initial_load_path)
            logger.info("initialized from Hugging Face weights %s", self.cfg.initial_load_path)
            return 0
        if self.cfg.initial_load_path:
            path = resolve_checkpoint(self.cfg.initial_load_path)
            model_only = self.cfg.initial_load_model_only
            exclude = [k for k in self.loadable if k != "model"] if model_only else []
            error = self._try_load(path, exclude, resume=False)
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
            path = step_dir(self.folder, step)
            try:
                record = read_marker(path)
                if "weights_only" not in record and "healthy" not in record and \
                        self.optimizer is not None:
                    metadata = storage_for(path).reader(path).read_metadata()
                    if not any(k.startswith("optimizer") for k in metadata.state_dict_metadata):
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
        skip = self.not_resumable
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
        weights = [s for s in steps if s and self.not_resumable.get(s) == WEIGHTS_ONLY]
        if weights:
            only = (f", and {self.folder} holds no full-state checkpoint"
                    if key == "checkpoint.initial_load_path" else "")
            raise ConfigError(
                f"checkpoint {step_dir(self.folder, weights[-1])} holds weights only "
                "(checkpoint.last_save_model_only): it cannot resume a run (no optimizer, LR "
                f"schedule, data position or counters){only}; to train from these weights, "
                "start a new run (another job.run_name) with checkpoint.initial_load_path = "
                f"{step_dir(self.folder, weights[-1])}", key)

    def _set_aside(self, step: int) -> None:
        """After resuming from `step`: move the newer steps no resume takes (weights only,
        saved while updates were skipped) aside, so that this run's saves never replace them
        and no later resume mixes them with this run's new steps."""
        newer = {s for s in self.not_resumable if s > step}
        if not newer:
            return
        error = None
        if self.rank == 0:
            try:
                moved, dest = move_aside(self.folder, step, only=newer)
                logger.warning("moved the checkpoints %s (never resumed from) to %s (not "
                               "deleted); this run continues from step %d", moved, dest, step)
            except OSError as e:
                error = f"could not move the newer checkpoints aside: {describe_failure(e)}"
        if error := self._one(self._gather(error)):
            raise RuntimeError(f"resuming from step {step}: {error}")
        self.steps = [s for s in self.steps if s not in newer]
        for s in newer:
            self.not_resumable.pop(s)

    def _clean_partial(self, scanned: dict[int, str]) -> None:
        """Rank 0: warn about the steps that are never loaded, and delete the partial ones (a
        save or upload cut short: no marker, so nothing trusts them; on an object store they
        would linger and cost). Steps holding NaN/inf stay for inspection."""
        warn_unusable(self.folder, scanned)
        for step, state in sorted(scanned.items()):
            if state == "partial":
                try:
                    delete_step(step_dir(self.folder, step))
                except OSError as e:
                    logger.warning("could not delete the incomplete checkpoint %s: %s",
                                   step_dir(self.folder, step), describe_failure(e))

    def _try_load(self, path: Location, exclude: list[str], resume: bool) -> str | None:
        """Load `path` on every rank, or none: the cause (one line, every rank's) if any rank
        cannot. Raises ConfigError on every rank when the checkpoint cannot fit this config."""
        # 1. Rank-local checks, before any collective: checksums (each rank a share of the
        # files), config fit (keys, shapes, batch size), and the templates to load into.
        sds, problem, misfit, grow, fresh = {}, None, None, None, {}
        try:
            marker = read_marker(path)
            if self.cfg.checksums:
                problem = check_files(path, marker, self.rank, self.world)
            if problem is None:
                if resume:  # the data loader's position is kept only for the same data
                    exclude = self._data_change(path, marker, exclude)
                metadata = storage_for(path).reader(path).read_metadata()
                present = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
                sds = {k: s.state_dict() for k, s in self._wanted(path, present, exclude).items()}
                fresh = fresh_adapters(sds, metadata, resume)  # LoRA on a base checkpoint
                grow = self._plan_growth(path, metadata, marker, sds, resume)
                mismatch = structure_mismatch(
                    metadata, {k: sds[k] for k in ("model", "optimizer") if k in sds})
                if mismatch and (lora := checkpoint_misfit(path, self.run_info.get("config_toml"))):
                    raise ConfigError(*lora)
                if mismatch:
                    raise ConfigError(
                        f"checkpoint {path} does not fit this model (saved shapes in "
                        f"{join(path, '.metadata')}): {mismatch}; did model.name or model.flavor "
                        "change?", "model.flavor")
                if resume:
                    self._check_batch(path, marker)
        except ConfigError as e:
            misfit = str(e)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - unreadable
            problem = describe_failure(e)
        if problem := self._agreed(misfit, problem):
            return problem
        # 2. Read (DCP gathers every rank's read errors and raises on all of them).
        try:
            dcp.load(sds, storage_reader=storage_for(path).reader(path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            problem, misfit = describe_failure(e), untrusted_cause(e)  # code in it: stop
        if problem := self._agreed(misfit, problem):
            return problem
        # 3. Apply (rank-local: a failure here is agreed on like the others; a ConfigError,
        # e.g. the data loader refusing another data-parallel degree, stops every rank).
        try:
            if grow:
                self._grow(sds["model"], *grow)
            if fresh:
                sds["model"].update(fresh)
            for key, sd in sds.items():
                self.states[key].load_state_dict(sd)
        except ConfigError as e:
            misfit = str(e)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            problem = describe_failure(e)
        return self._agreed(misfit, problem)

    def _plan_growth(self, path: Location, metadata, marker: dict, sds: dict, resume: bool):
        """For a new run whose vocabulary adds tokens to the checkpoint's: read the saved
        embedding/output rows whole (plain tensors replace the model's in `sds`) and return
        what `_grow` needs; None when nothing grows (vocab_resize.plan_growth raises on a
        vocabulary that cannot grow)."""
        if "model" not in sds:
            return None
        keys, saved_vocab = plan_growth(path, metadata, marker, sds["model"],
                                        self.run_info.get("tokenizer"), resume)
        if not keys:
            return None
        if "optimizer" in sds:
            raise ConfigError(
                f"checkpoint {path} has a smaller vocabulary than this run, and its optimizer "
                "state cannot grow with the embeddings: set checkpoint.initial_load_model_only "
                "= true (a new stage takes the weights only)", "checkpoint.initial_load_model_only")
        targets = {k: sds["model"][k] for k in keys}
        sds["model"].update(full_templates(metadata, sds["model"], keys))
        return targets, saved_vocab

    def _grow(self, model_sd: dict, targets: dict, saved_vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)  # the same rows on every rank
        for key, like in targets.items():  # embedding first, then output (as transformers)
            saved_rows, rows = model_sd[key].shape[0], like.shape[0]
            model_sd[key] = place(grow_rows(model_sd[key], saved_vocab, rows, generator), like)
        logger.info("vocabulary grown at load: %d -> %d ids (%d -> %d rows with padding); rows "
                    "from id %d drawn around the mean of the saved rows in %s", saved_vocab,
                    self.run_info["tokenizer"]["vocab_size"], saved_rows, rows, saved_vocab,
                    ", ".join(targets))

    def _agreed(self, misfit: str | None, problem: str | None) -> str | None:
        """Every rank's outcome: a ConfigError on every rank if any rank found the checkpoint
        cannot fit this config, else every rank's problem as one line (None: all loaded)."""
        outcomes = self._gather((misfit, problem))
        if misfit := self._one([m for m, _ in outcomes]):
            raise ConfigError(misfit, "checkpoint")
        return self._one([p for _, p in outcomes])

    def _check_batch(self, path: Location, marker: dict) -> None:
        saved, now = marker.get("global_batch_size"), self.run_info.get("global_batch_size")
        if saved and now and saved != now and not self.cfg.allow_global_batch_change:
            raise ConfigError(
                f"checkpoint {path} was trained with a global batch of {saved} sequences, this "
                f"config makes {now}: set training.global_batch_size = {saved} to keep it "
                "(gradient accumulation makes up the difference), or "
                "checkpoint.allow_global_batch_change = true to resume with the new batch",
                "checkpoint.allow_global_batch_change")

    def _data_change(self, path: Location, marker: dict, exclude: list[str]) -> list[str]:
        """The states not to load, given whether the data differs from the checkpoint's
        (torchllm.data.fingerprint): unchanged, the same; changed, a ConfigError
        (on_data_change = 'error') or the data loader added (its position restarts)."""
        saved, now = marker.get("data"), self.run_info.get("data")
        if not saved or not now or "dataloader" in exclude:
            return exclude  # a checkpoint from before fingerprints: nothing to compare
        if saved.get("tokenizer_sha256") != now.get("tokenizer_sha256"):
            return exclude  # another tokenizer: the identity check next names both files
        what = "; ".join(data_changes(saved, now))
        if not what:
            return exclude
        if self.cfg.on_data_change == "error":
            raise ConfigError(
                f"checkpoint {path} was saved reading other data ({what}): its data position "
                "does not point into this data order; resume with the data it was saved with, or "
                "set checkpoint.on_data_change = 'restart' to read this data from its beginning "
                "(step and token counters kept)", "checkpoint.on_data_change")
        logger.warning("the data changed since %s (%s): reading it from its beginning in its "
                       "new order (data position reset; step, token counters and LR schedule "
                       "kept; checkpoint.on_data_change = 'restart')", path, what)
        return [*exclude, "dataloader"]

    def _after_resume(self, path: Location) -> None:
        """One warning listing the config changes since `path` was saved, and what wins."""
        saved, now = join(path, "config.toml"), self.run_info.get("config_toml")
        store = storage_for(saved)
        if now and store.is_file(saved):
            changes = config_changes(store.read_bytes(saved).decode(), now,
                                     self.cfg.optimizer_hparams_from)
            if changes:
                logger.warning("resuming with %d config change(s) since %s: %s", len(changes),
                               saved, "; ".join(changes))
        if self.cfg.optimizer_hparams_from == "config" and self.hparams is not None:
            apply_hparams(self.optimizer, self.lr_scheduler, self.hparams)
            logger.info("optimizer hyperparameters (peak LR, betas, eps, weight decay) taken "
                        "from the config (checkpoint.optimizer_hparams_from = 'config')")
        elif self.optimizer is not None and self.lr_scheduler is not None and \
                hasattr(self.lr_scheduler, "lr_lambdas"):
            current_lr(self.optimizer, self.lr_scheduler)

    def _wanted(self, path: Location, present: set[str], exclude: list[str]) -> dict[str, Any]:
        wanted = {}
        for key, state in self.states.items():
            kind = "dataloader" if key == self.dataloader_key else "rng" if key == self.rng_key else key
            if kind in exclude:
                continue
            if key in present:
                wanted[key] = state
            elif kind == "model":
                raise ConfigError(f"checkpoint {path} holds no model weights")
            elif kind == "dataloader" and any(k.startswith("dataloader_dp") for k in present):
                saved = sorted(k for k in present if k.startswith("dataloader_dp"))
                raise ConfigError(
                    f"checkpoint {path} holds the data-loader positions of {len(saved)} "
                    f"data-parallel ranks ({', '.join(saved)}), not of this rank's "
                    f"{self.dataloader_key}: resuming with another data-parallel degree cannot "
                    "continue the same data order; add 'dataloader' to "
                    "checkpoint.exclude_from_loading to restart the data order instead",
                    "checkpoint.exclude_from_loading",
                )
            elif kind != "rng":
                logger.warning("checkpoint %s has no %s state; it starts fresh", path, kind)
        return wanted
