"""Convert model weights between a DCP checkpoint and one consolidated file.

    python -m torchllm.hf.convert to-file CHECKPOINT OUT.safetensors|OUT.pt [--dtype bfloat16]
        [--overwrite]
    python -m torchllm.hf.convert to-dcp  WEIGHTS.safetensors|WEIGHTS.pt OUT_STEP_DIR
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
import sys
from pathlib import Path

import torch

from torchllm.checkpoint import EXPORT_DTYPES, open_checkpoint, step_of
from torchllm.hf.files import (
    refuse_existing,
    refuse_step_folder,
    save_safetensors,
    save_seed_checkpoint,
    temp_sibling,
)


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
    weights = open_checkpoint(checkpoint).weights()  # checksums, data-only metadata
    if dtype is not None:
        target = EXPORT_DTYPES[dtype]
        weights = {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}
    save_weights_file(weights, out, overwrite)


def to_dcp(weights_path: str, out_dir: str, overwrite: bool = False) -> None:
    out = Path(out_dir)
    step = step_of(out)
    if step is None:
        raise ValueError(f"{out}: the output folder must be named step-<N> (e.g. .../step-0)")
    refuse_step_folder(out, overwrite)
    save_seed_checkpoint(load_weights_file(weights_path), out, step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllm.hf.convert",
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
