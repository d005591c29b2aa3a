"""Loading one step into a Checkpointer's states on every rank, or on none, and saying why a
step did not load (which rank, file, key or shape).

Three agreed phases, so no rank is ever left inside a collective alone: rank-local checks
(checksums, keys and shapes, batch size, data and vocabulary changes) -> DCP's read through the
reader (which itself raises on every rank when one fails) -> applying the states (rank-local
again). A step that cannot fit this config (a ConfigError on any rank) stops every rank; any
other problem is returned, so the resume can fall back to an earlier step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from torchllm.checkpoint.resume.agree import RankAgreement
from torchllm.checkpoint.index import untrusted_cause
from torchllm.checkpoint.integrity import check_files, describe_failure
from torchllm.checkpoint.layout import step_of
from torchllm.checkpoint.step import Step
from torchllm.checkpoint.resume.hparams import apply_hparams, config_changes, current_lr
from torchllm.checkpoint.stage.vocab_resize import full_templates, grow_vocab, plan_growth
from torchllm.config.job_config import ConfigError
from torchllm.data.fingerprint import changes as data_changes
from torchllm.log import logger
from torchllm.models.lora import checkpoint_misfit, fresh_adapters
from torchllm.storage import Location


class StepLoader:
    """Loads a step into `states` (key -> object with load_state_dict(); this rank's data
    loader and RNG states are under `dataloader_key` and `rng_key`). `hparams`: the configured
    optimizer hyperparameters (checkpoint.optimizer_hparams_from = 'config' puts them back)."""

    def __init__(self, ccfg, states: dict[str, Any], dataloader_key: str, rng_key: str,
                 agree: RankAgreement, optimizer=None, lr_scheduler=None,
                 hparams: list[dict] | None = None, run_info: dict | None = None):
        self.cfg, self.states, self.agree = ccfg, states, agree
        self.dataloader_key, self.rng_key = dataloader_key, rng_key
        self.optimizer, self.lr_scheduler, self.hparams = optimizer, lr_scheduler, hparams
        self.run_info = run_info or {}
        self.loaded: Step | None = None  # the step `load` opened last
        # Saved states read into another key's object: a rank the checkpoint has no data
        # position for (more data-parallel ranks than it was saved with) reads rank 0's, and
        # the loader continues the global batch order from it (data/loader.py).
        self.read_as: dict[str, str] = {}

    def load(self, path: Location, exclude: list[str], resume: bool) -> str | None:
        """Load `path` on every rank, or none: the cause (one line, every rank's) if any rank
        cannot. Raises ConfigError on every rank when the checkpoint cannot fit this config."""
        # 1. Rank-local checks, before any collective: the step opened once (marker, index
        # checked against its files), checksums (each rank a share of the files), config fit
        # (keys, shapes, batch size, data, vocabulary), and the templates to load into.
        sds, problem, misfit, grow, fresh = {}, None, None, None, {}
        try:
            step = self.loaded = Step.open(path)
            if self.cfg.checksums:
                problem = check_files(step.path, step.marker, self.agree.rank, self.agree.world)
            if problem is None:
                sds, grow, fresh = self._fit(step, exclude, resume)
        except ConfigError as e:
            misfit = str(e)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - unreadable
            problem = describe_failure(e)
        if problem := self._agreed(misfit, problem):
            return problem
        # 2. Read (DCP gathers every rank's read errors and raises on all of them).
        try:
            step.load(sds)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            problem, misfit = describe_failure(e), untrusted_cause(e)  # code in it: stop
        if problem := self._agreed(misfit, problem):
            return problem
        # 3. Apply (rank-local: a failure here is agreed on like the others; a ConfigError,
        # e.g. the data loader refusing another data-parallel degree, stops every rank).
        try:
            if grow:
                grow_vocab(sds["model"], *grow, self.run_info["tokenizer"]["vocab_size"])
            if fresh:
                sds["model"].update(fresh)
            for key, sd in sds.items():
                self.states[self.read_as.get(key, key)].load_state_dict(sd)
        except ConfigError as e:
            misfit = str(e)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            problem = describe_failure(e)
        return self._agreed(misfit, problem)

    def _fit(self, step: Step, exclude: list[str], resume: bool):
        """(state dicts to load into, vocabulary growth or None, fresh LoRA adapters) for
        `step`; ConfigError when it cannot fit this config."""
        where = str(step.path)
        if resume:
            self._check_batch(where, step.marker)
            exclude = self._data_change(where, step.marker, exclude)  # position: same data
        sds = {k: s.state_dict() for k, s in self._wanted(where, step.states, exclude).items()}
        # A new run whose vocabulary adds tokens to the checkpoint's: the saved embedding /
        # output rows are read whole (plain tensors replace the model's in `sds`) and grown
        # at apply (vocab_resize.plan_growth raises on a vocabulary that cannot grow).
        keys, saved_vocab = plan_growth(step.path, step.metadata, step.marker, sds["model"],
                                        self.run_info.get("tokenizer"), resume) \
            if "model" in sds else ([], 0)
        grow = None
        if keys and "optimizer" in sds:
            raise ConfigError(
                f"checkpoint {where} has a smaller vocabulary than this run, and its optimizer "
                "state cannot grow with the embeddings: set checkpoint.initial_load_model_only "
                "= true (a new stage takes the weights only)", "checkpoint.initial_load_model_only")
        if keys:
            grow = {k: sds["model"][k] for k in keys}, saved_vocab
            sds["model"].update(full_templates(step.metadata, sds["model"], keys))
        fresh = fresh_adapters(sds, step.metadata, resume)  # LoRA on a base checkpoint
        lora = checkpoint_misfit(step.config_text, self.run_info.get("config_toml"), where,
                                 resume)
        mismatch = structure_mismatch(
            step.metadata, {k: sds[k] for k in ("model", "optimizer") if k in sds})
        if mismatch and lora:
            raise ConfigError(*lora)
        if mismatch:
            raise ConfigError(
                f"checkpoint {where} does not fit this model (saved shapes in "
                f"{where}/.metadata): {mismatch}; did model.name or model.flavor change?",
                "model.flavor")
        if kinds := dtype_mismatch(step.metadata, sds):
            raise ConfigError(f"checkpoint {where}/.metadata records {kinds}, which cannot "
                              "hold its values: the step is not this model's (replace it with "
                              "one from a trusted source)", "checkpoint")
        return sds, grow, fresh

    def _agreed(self, misfit: str | None, problem: str | None) -> str | None:
        """Every rank's outcome: a ConfigError on every rank if any rank found the checkpoint
        cannot fit this config, else every rank's problem as one line (None: all loaded)."""
        outcomes = self.agree.gather((misfit, problem))
        if misfit := self.agree.one([m for m, _ in outcomes]):
            raise ConfigError(misfit, "checkpoint")
        return self.agree.one([p for _, p in outcomes])

    def _check_batch(self, path: str, marker: dict) -> None:
        saved, now = marker.get("global_batch_size"), self.run_info.get("global_batch_size")
        if saved and now and saved != now and not self.cfg.allow_global_batch_change:
            raise ConfigError(
                f"checkpoint {path} was trained with a global batch of {saved} sequences, this "
                f"config makes {now}: set training.global_batch_size = {saved} to keep it "
                "(gradient accumulation makes up the difference), or "
                "checkpoint.allow_global_batch_change = true to resume with the new batch",
                "checkpoint.allow_global_batch_change")

    def _data_change(self, path: str, marker: dict, exclude: list[str]) -> list[str]:
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

    def after_resume(self, path: Location) -> None:
        """One warning listing the config changes since `path` was saved, and what wins."""
        saved, now = self.loaded.config_text, self.run_info.get("config_toml")
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


def _flat_tensors(obj, prefix: str) -> dict[str, torch.Tensor]:
    """DCP's flattened names (dict keys joined by '.') of the tensors reachable through dicts."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}.{k}"))
        return out
    return {}


def _kind(dtype: torch.dtype) -> str:
    return "complex" if dtype.is_complex else "floating-point" if dtype.is_floating_point \
        else "bool" if dtype == torch.bool else "integer"


def dtype_mismatch(metadata: Metadata, states: dict[str, dict]) -> str | None:
    """The first saved tensor whose dtype is of another kind (complex, floating-point,
    integer, bool) than the tensor it would load into: a complex64 weight for a float32
    parameter would lose its imaginary part, a float for an integer its fraction."""
    saved = metadata.state_dict_metadata
    for name, t in (kv for key, sd in states.items() for kv in _flat_tensors(sd, key).items()):
        md = saved.get(name)
        if isinstance(md, TensorStorageMetadata) and type(t) in (torch.Tensor, torch.nn.Parameter,
                                                                 DTensor):
            was, now = md.properties.dtype, t.dtype
            if _kind(was) != _kind(now) and not (_kind(now) == "floating-point"
                                                 and _kind(was) in ("integer", "bool")):
                return f"{name} as {str(was).removeprefix('torch.')} ({_kind(was)}), for a " \
                       f"{str(now).removeprefix('torch.')} tensor"
    return None


def structure_mismatch(metadata: Metadata, states: dict[str, dict], limit: int = 4) -> str | None:
    """What keeps `states` (top-level key -> state dict about to be loaded) from matching the
    checkpoint: missing keys, unexpected model keys, and saved vs expected shapes."""
    saved = metadata.state_dict_metadata
    # Plain tensors and DTensors only: quantized subclasses (8-bit optimizer moments) are laid
    # out by their own flattening, which DCP checks itself.
    expected = {k: v for key, sd in states.items() for k, v in _flat_tensors(sd, key).items()
                if type(v) in (torch.Tensor, torch.nn.Parameter, DTensor)}
    missing, shapes = [], []
    for name, t in expected.items():
        md = saved.get(name)
        if md is None:
            missing.append(name)
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(t.shape):
            shapes.append(f"{name} saved {list(md.size)} vs expected {list(t.shape)}")
    unexpected = []
    if "model" in states:
        unexpected = [k for k in saved if k.startswith("model.") and k not in expected]
    parts = []
    for what, items in (("shape mismatch", shapes), ("missing", missing),
                        ("unexpected", unexpected)):
        if items:
            more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
            parts.append(f"{what}: {', '.join(items[:limit])}{more}")
    return "; ".join(parts) or None
