"""Convert model weights between a DCP checkpoint and one consolidated file.

    python -m torchllm.checkpoint.convert to-file CHECKPOINT OUT.safetensors|OUT.pt [--dtype bfloat16]
        [--overwrite]
    python -m torchllm.checkpoint.convert to-dcp  WEIGHTS.safetensors|WEIGHTS.pt OUT_STEP_DIR
        [--overwrite]

CHECKPOINT may be a run folder (its latest complete checkpoint), a checkpoint folder or a
step-<N> folder. `to-dcp` writes a complete weights-only checkpoint folder, usable as
`checkpoint.initial_load_path` (a seed checkpoint). Needs no model code: shapes and dtypes come
from the checkpoint's own metadata, so it works for any registered model family. An existing
output is refused unless --overwrite; the output is written under a temporary name and renamed
when complete, and its files' modes follow the umask.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchllm.checkpoint.integrity import open_for_reading
from torchllm.checkpoint.layout import EXPORT_DTYPES, mark_complete, step_of
from torchllm.checkpoint.storage import as_location, storage_for

PREFIX = "model."


def load_dcp_tensors(path: str | Path, prefix: str = PREFIX, opened: bool = False,
                     what: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint whose flattened key starts with `prefix`, as plain CPU
    tensors keyed by the rest of the key (e.g. "model." -> parameter names). The checkpoint is
    checked first (integrity.open_for_reading: checksums, data-only metadata) unless `opened`
    says the caller already did; `what` names the tensors in the error when there are none."""
    step_path = as_location(path) if opened else open_for_reading(path)
    metadata = storage_for(step_path).reader(step_path).read_metadata()
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not tensors:
        raise ValueError(f"checkpoint {step_path} holds no {what or f'tensors under {prefix!r}'}")
    dcp.load(tensors, storage_reader=storage_for(step_path).reader(step_path), no_dist=True)
    return {key[len(prefix):]: value for key, value in tensors.items()}


def load_dcp_weights(path: str | Path, opened: bool = False) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint, keyed by parameter name."""
    return load_dcp_tensors(path, PREFIX, opened, what="model weights")


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


def save_weights_file(weights: dict[str, torch.Tensor], out: str | Path,
                      overwrite: bool = False) -> None:
    out = Path(out)
    if out.suffix not in (".safetensors", ".pt"):
        raise ValueError(f"{out}: the output must end in .safetensors or .pt")
    refuse_existing(out, overwrite)
    tmp = temp_sibling(out, "tmp")
    try:
        if out.suffix == ".safetensors":
            save_safetensors({k: v.contiguous() for k, v in weights.items()}, tmp)
        else:
            torch.save(weights, tmp)
        tmp.replace(out)  # never leave a half-written file under the final name
    finally:
        tmp.unlink(missing_ok=True)


def load_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix == ".pt":
        weights = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(weights, dict) or not all(torch.is_tensor(v) for v in weights.values()):
            raise ValueError(f"{path} is not a flat {{name: tensor}} state dict")
        return weights
    raise ValueError(f"{path}: the input must end in .safetensors or .pt")


def to_file(checkpoint: str, out: str, dtype: str | None = None, overwrite: bool = False) -> None:
    if Path(out).suffix not in (".safetensors", ".pt"):
        raise ValueError(f"{out}: the output must end in .safetensors or .pt")
    refuse_existing(Path(out), overwrite)  # before the load: fail fast
    weights = load_dcp_weights(checkpoint)
    if dtype is not None:
        target = EXPORT_DTYPES[dtype]
        weights = {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}
    save_weights_file(weights, out, overwrite)


def save_seed_checkpoint(weights: dict[str, torch.Tensor], out: Path, step: int,
                         extra=None) -> None:
    """A complete weights-only DCP checkpoint at out (written beside it, then renamed).
    `extra(folder)`: writes more files into the unfinished folder, returns the marker's fields."""
    tmp = temp_sibling(out, "tmp")
    try:
        dcp.save({"model": weights}, checkpoint_id=str(tmp), no_dist=True)
        mark_complete(tmp, step, **(extra(tmp) if extra else {}))
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def to_dcp(weights_path: str, out_dir: str, overwrite: bool = False) -> None:
    out = Path(out_dir)
    step = step_of(out)
    if step is None:
        raise ValueError(f"{out}: the output folder must be named step-<N> (e.g. .../step-0)")
    refuse_step_folder(out, overwrite)
    save_seed_checkpoint(load_weights_file(weights_path), out, step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllm.checkpoint.convert",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-file", help="DCP checkpoint -> one .safetensors/.pt weights file")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default=None,
                   help="cast floating-point weights (default: keep the saved dtype)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p = sub.add_parser("to-dcp", help="one .safetensors/.pt weights file -> DCP seed checkpoint")
    p.add_argument("weights")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-file":
            to_file(args.checkpoint, args.out, args.dtype, args.overwrite)
        else:
            to_dcp(args.weights, args.out_dir, args.overwrite)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out if args.command == 'to-file' else args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
