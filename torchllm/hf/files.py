"""Writing outputs whole or not at all: a new file or folder is written beside its final name and
renamed when complete (an existing one is replaced only when asked), with the mode the umask
gives; and a seed checkpoint (a complete weights-only DCP step) written that way.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchllm.checkpoint import mark_complete
from torchllm.checkpoint.index import dcp_writer
from torchllm.checkpoint.integrity import folder_checksums


def file_mode() -> int:
    """The mode a new file gets under this process's umask (0o666 & ~umask)."""
    try:
        with open("/proc/self/status") as f:  # Linux: read it without changing it
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict | None = None) -> None:
    """safetensors' save_file, whose file is 0600 whatever the umask, with the umask's mode."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, file_mode())


def refuse_existing(out: Path, overwrite: bool, what: str = "") -> None:
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it{what}, or "
                              "choose a new name")


def refuse_step_folder(out: Path, overwrite: bool) -> None:
    """A step folder is replaced only with overwrite, and only if it is a DCP checkpoint."""
    refuse_existing(out, overwrite, " (a step folder)")
    if out.exists() and any(out.iterdir()) and not (out / ".metadata").is_file():
        raise FileExistsError(f"{out} is not a DCP checkpoint folder (no .metadata); "
                              "--overwrite replaces only a checkpoint: choose a new step folder")


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder tmp to out, replacing what out held (moved aside first)."""
    out = out.absolute()
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def temp_sibling(out: Path, tag: str) -> Path:
    """A fresh temporary path beside out (same filesystem: the final rename is atomic)."""
    out = out.absolute()  # "." has no name to put beside
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{tag}-{os.getpid()}")
    if tmp.is_dir():  # left by a killed run of this pid's predecessor
        shutil.rmtree(tmp)
    else:
        tmp.unlink(missing_ok=True)
    return tmp


def save_seed_checkpoint(weights: dict[str, torch.Tensor], out: Path, step: int,
                         extra=None) -> None:
    """A complete weights-only DCP checkpoint at out (written beside it, then renamed).
    `extra(folder)`: writes more files into the unfinished folder, returns the marker's fields."""
    tmp = temp_sibling(out, "tmp")
    try:
        dcp.save({"model": weights}, storage_writer=dcp_writer(tmp), no_dist=True)
        fields = extra(tmp) if extra else {}
        mark_complete(tmp, step, folder_checksums(tmp), **fields)  # its files, as a save's
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
