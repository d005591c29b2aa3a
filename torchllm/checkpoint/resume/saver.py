"""Writing a step: sharded DCP saves, synchronous or in the background, committed by a marker.

Every rank writes its own shards of one DCP directory per step. A save becomes visible to
loading and retention only when rank 0 writes the COMPLETE marker (with each file's CRC-32)
after every rank finished and no saved value was NaN/inf, so a crash mid-save never damages
what was already on disk and a poisoned state is never resumed from. The marker also says when a
step is no resume candidate (weights only; saved while the loss guard skipped updates).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchllm.checkpoint.resume.agree import RankAgreement
from torchllm.checkpoint.integrity import (
    describe_failure,
    folder_checksums,
    human,
    is_disk_full,
    nonfinite_and_bytes,
    tensors_of,
)
from torchllm.checkpoint.index import dcp_writer
from torchllm.checkpoint.layout import (
    EXPORT_DTYPES,
    mark_complete,
    mark_nonfinite,
)
from torchllm.checkpoint.resume.mirror import Mirror, done_future
from torchllm.checkpoint.resume.retention import Retention
from torchllm.checkpoint.state import ModelState, OptimizerState
from torchllm.config.job_config import ConfigError
from torchllm.log import logger
from torchllm.storage import Location, join


class CheckpointSaveError(RuntimeError):
    """A save failed (disk full, I/O error): one line with the folder and the bytes involved."""


class Saver:
    """Saves `states` (key -> object with state_dict()) of `model` into `retention.folder`."""

    def __init__(self, ccfg, states: dict, model: torch.nn.Module, retention: Retention,
                 agree: RankAgreement, device: torch.device, mirror: Mirror | None,
                 run_info: dict):
        self.cfg, self.states, self.model = ccfg, states, model
        self.retention, self.agree, self.device = retention, agree, device
        self.folder = retention.folder  # layout.StepFolders: bound once
        self.storage = self.folder.store.storage
        self.mirror, self.run_info = mirror, run_info
        self.rank = agree.rank
        self.pending: dict | None = None  # the background save: step, future, stager, finite
        self.staging = None
        self.needed = 0  # bytes of the save in progress (for error messages)
        self.async_options = None
        self.async_group = None

    def setup_async(self, mode: str, device: torch.device) -> None:
        """Stage (copy to host memory) in a background thread, then write in another.

        Weights change only in optimizer.step(), so staging overlaps the next step's forward
        and backward; the trainer calls wait_for_staging() before stepping the optimizer.
        """
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._stager_cls = DefaultStager  # one per save: torch < 2.13 closes it after one
        if mode == "async_with_pinned_mem":
            if device.type != "cuda":
                raise ConfigError(
                    "checkpoint.async_mode = 'async_with_pinned_mem' stages through pinned host "
                    "memory and needs CUDA; on CPU use 'async'", "checkpoint.async_mode",
                )
            options = StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                     use_async_staging=True, use_non_blocking_copy=True)
        else:
            options = StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                     use_async_staging=True, use_non_blocking_copy=False)
        self.async_options = options
        if dist.is_initialized():
            # Background saves talk on their own gloo group, never interleaving with training's.
            self.async_group = dist.new_group(backend="gloo")

    def save(self, step: int, last: bool = False, model_only: bool = False,
             unhealthy: str | None = None) -> None:
        """Save `step` (blocking only for staging when async); see Checkpointer.save."""
        self.wait()
        path = self.folder.step_path(step)
        self.retention.known()  # listed once: never another run's folder (identity.py)
        steps, skip = self.retention.steps, self.retention.not_resumable
        if steps is not None and step in steps:
            logger.warning("checkpoint %s exists and is replaced by this save (%s)", path,
                           skip.get(step, "a complete checkpoint"))
        self.retention.forget(step)
        early = None  # rank 0's error clearing the step: agreed on with the counts below
        if self.rank == 0:  # (the next collective keeps the others from writing before this)
            try:
                self.folder.delete(step)  # a crashed or stale save of this step; complete ones rewritten
                if self.mirror is not None:
                    self.mirror.remove(step)
            except Exception as e:  # noqa: BLE001 - any store error (botocore's are no OSError)
                early = self._cause(e)
        export = last and self.cfg.last_save_model_only
        model_only = model_only or export
        if model_only:
            dtype = EXPORT_DTYPES[self.cfg.export_dtype] if export else torch.float32
            state = {"model": ModelState(self.model, None if dtype == torch.float32 else dtype)}
            kind = {"weights_only": True, "weights_dtype": str(dtype).split(".")[-1]}
        else:
            state = self.states
            kind = {"healthy": False, "unhealthy": unhealthy} if unhealthy else {"healthy": True}
        t0 = time.perf_counter()
        # Before writing: NaN/inf anywhere (never marked complete), and room on the disk.
        tensors = tensors_of([s.state_dict() for s in state.values()
                              if isinstance(s, (ModelState, OptimizerState))])
        counts = self.agree.gather((*nonfinite_and_bytes(tensors), early))
        nonfinite, self.needed = sum(c[0] for c in counts), sum(c[1] for c in counts)
        early = self.agree.one([c[2] for c in counts])
        if early is not None:
            self._failed(step, early)
            return
        free = self.storage.free_bytes(self.folder.root)
        if not self.agree.all(free is None or free >= self.needed):
            self._failed(step, "not enough free space on that disk")
            return
        try:
            if self.mirror is None and (self.cfg.async_mode == "disabled" or model_only):
                dcp.save(state, storage_writer=dcp_writer(path))
            else:
                self._save_async(step, path, state, nonfinite, model_only, kind)
                logger.info("checkpoint %s: %s in the background (blocked %.2fs)", path,
                            "uploading" if self.mirror else "staging and writing",
                            time.perf_counter() - t0)
                return
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank
            self._failed(step, self._cause(e))
            return
        if self._complete(step, nonfinite, kind=kind):
            logger.info("saved checkpoint %s in %.2fs%s", path, time.perf_counter() - t0,
                        " (model only)" if model_only else "")

    def _save_async(self, step: int, path: Location, state: dict, nonfinite: int,
                    model_only: bool = False, kind: dict | None = None) -> None:
        """A background save: DCP's async save, and/or (local_mirror) a local save uploaded by a
        background thread. `pending["future"]` is done once this rank's part is written."""
        target = path if self.mirror is None else self.mirror.step_dir(step)
        if self.cfg.async_mode == "disabled" or model_only:  # mirror: write locally now
            dcp.save(state, storage_writer=dcp_writer(target))
            written, stager = done_future(), None
        else:
            written, stager = self._dcp_async(target, state)
        future = written if self.mirror is None else self.mirror.start(written, step, path)
        self.pending = {"step": step, "future": future, "stager": stager,
                        "nonfinite": nonfinite, "mirror": self.mirror is not None,
                        "kind": kind or {}}

    def _dcp_async(self, target: Location, state: dict):
        if self.device.type == "cuda":
            # DCP's staging stream does not wait for the compute stream: let the optimizer
            # step's kernels finish before the copies read the weights.
            torch.cuda.current_stream(self.device).synchronize()
        stager = self._stager_cls(self.async_options)
        try:
            response = dcp.async_save(state, storage_writer=dcp_writer(target),
                                      process_group=self.async_group, async_stager=stager)
        except BaseException:
            stager.close()
            raise
        self.staging = response.staging_completion
        return response.upload_completion, stager

    def wait_for_staging(self) -> None:
        """Block until a background save has copied the state; call before weights change."""
        if self.staging is not None:
            staging, self.staging = self.staging, None
            staging.result()

    def poll(self) -> None:
        """Finish a background save once every rank's part is written (every rank, each step:
        the ranks agree, so all of them finish it at the same step)."""
        if self.pending is not None and self.agree.all(self.pending["future"].done()):
            self.wait()

    def wait(self) -> None:
        """Block until the pending background save is written and committed (every rank)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        error, files = None, None
        try:
            self.wait_for_staging()
            result = pending["future"].result()
            files = result if pending["mirror"] else None  # the uploaded files' checksums
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed on below
            error = self._cause(e)
        finally:
            if pending["stager"] is not None:
                pending["stager"].close()
        gathered = self.agree.gather((error, files))  # commit only if every rank's write did
        error = self.agree.one([e for e, _ in gathered])
        if error is not None:
            self._failed(pending["step"], error)
        elif self._complete(pending["step"], pending["nonfinite"],
                            {k: v for _, f in gathered for k, v in (f or {}).items()}
                            if pending["mirror"] else None, pending["kind"]):
            logger.info("checkpoint step-%d written", pending["step"])

    def _complete(self, step: int, nonfinite: int, files: dict | None = None,
                  kind: dict | None = None) -> bool:
        """Every rank's shards are on disk: rank 0 commits (or flags NaN/inf); ranks agree.
        `files`: the checksums of every file, when the ranks computed them (local mirror);
        `kind`: the marker's fields saying whether the step is a resume candidate."""
        error = None
        if self.rank == 0:
            try:
                self._commit(step, nonfinite, files, kind)
                if self.mirror is not None:
                    self.mirror.remove(step)
            except Exception as e:  # noqa: BLE001 - any store error, not only OSError
                error = self._cause(e)
        error = self.agree.one(self.agree.gather(error))
        if error is not None:
            self._failed(step, error)
            return False
        if not nonfinite:
            self.retention.add(step, kind)
        return not nonfinite

    def _commit(self, step: int, nonfinite: int, files: dict | None = None,
                kind: dict | None = None) -> None:
        path = self.folder.step_path(step)
        if "config_toml" in self.run_info:
            self.storage.write_durably(join(path, "config.toml"), self.run_info["config_toml"])
        if nonfinite:
            what = f"{nonfinite} saved tensors hold NaN or inf"
            mark_nonfinite(path, what)
            logger.error("checkpoint %s is not marked complete: %s; it is kept for inspection "
                         "and never loaded or counted by retention", path, what)
            return
        if not self.cfg.checksums:
            files = None
        elif files is None:  # read back (on an object store: downloaded) by rank 0
            files = folder_checksums(path)
        info = {k: v for k, v in self.run_info.items() if k != "config_toml"}
        mark_complete(path, step, files, **info, **(kind or {}))  # last: the commit point

    def _cause(self, e: BaseException) -> str:
        """One line for a failed store operation; a full disk says so (torch's short-write
        error does not), a timeout names the key that bounds it."""
        cause = describe_failure(e)
        if not self.storage.remote and is_disk_full(e):
            return f"no space left on {self.folder} ({cause})"
        if self.storage.remote and "Timeout" in cause:
            cause += (f" (no answer within checkpoint.store_timeout_s = "
                      f"{self.cfg.store_timeout_s:g} s)")
        return cause

    def _failed(self, step: int, cause: str) -> None:
        """Every rank: remove the partial folder, keep the rest, stop or carry on."""
        path = self.folder.step_path(step)
        removed = "partial folder removed"
        if self.rank == 0 and "checkpoint.store_timeout_s" in cause:  # it would wait again
            removed = "partial folder left (the next resume deletes it)"
        elif self.rank == 0:
            try:
                self.folder.delete(step)
            except Exception:  # noqa: BLE001 - a store that fails: botocore's are no OSError
                removed = "partial folder left (the next resume deletes it)"
        if self.mirror is not None:
            self.mirror.remove(step)
        free = self.storage.free_bytes(self.folder.root)
        room = "" if free is None else f"; {human(free)} free"
        # An object store that just failed is not listed again: the steps known so far.
        steps = self.retention.steps
        kept = steps if self.storage.remote and steps is not None else self.retention.known()
        msg = (f"checkpoint step {step} could not be saved to {path}: {cause} (it needs about "
               f"{human(self.needed)}{room}); {removed}, earlier checkpoints "
               f"kept: {kept or 'none'}")
        if self.cfg.on_save_error == "continue":
            logger.error("%s; training continues and saves again at the next interval "
                         "(checkpoint.on_save_error = 'continue')", msg)
            return
        raise CheckpointSaveError(msg + " (checkpoint.on_save_error = 'continue' keeps training)")

    def close(self) -> None:
        """Finish a pending save. While an exception unwinds (other ranks may be gone), rank 0
        commits on its own what its DCP future says every rank wrote."""
        if sys.exc_info()[0] is None:
            self.wait()
        elif self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                result = pending["future"].result()
                # With a mirror, rank 0 cannot know that the other ranks' uploads finished:
                # the step stays without its marker (deleted by the next resume).
                if self.rank == 0 and (not pending["mirror"] or self.agree.world == 1):
                    self._commit(pending["step"], pending["nonfinite"],
                                 result if pending["mirror"] else None, pending["kind"])
                    if not pending["nonfinite"]:
                        self.retention.add(pending["step"], pending["kind"], agree=False)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - already failing
                logger.error("checkpoint step-%d was not completed: %s", pending["step"],
                             describe_failure(e))
            finally:
                if pending["stager"] is not None:
                    pending["stager"].close()
