"""Hugging Face interop: export a checkpoint as a `transformers` model folder, import one back.

    python -m torchllm.hf export --checkpoint RUN_OR_CKPT --out HF_DIR
        [--dtype bfloat16] [--max-shard-size 5GB] [--vocab-size N] [--overwrite] [--adapter]
        [--section.key=value ...]
    python -m torchllm.hf import --hf HF_DIR --out CKPT/step-0
        --job.config_file RUN.toml [--dtype float32] [--overwrite] [--section.key=value ...]

`export` reads the config the step was written under (the step folder's `config.toml`, else
the run's) to rebuild the model's args and writes `config.json`, `model.safetensors` (sharded
with an index over the size limit) and the run's tokenizer (SentencePiece, tiktoken as a
tokenizer.json, or tokenizer.json; with the chat template a chat run trained with, see
tokenizer.py): a folder `from_pretrained` loads (export.py). `import` writes a complete
weights-only DCP checkpoint for the model the given config describes (usable as
`checkpoint.initial_load_path`; load.py). A run can also start straight from a HF folder with
`checkpoint.initial_load_in_hf = true` (load.load_initial_weights).
Extra `--section.key=value` arguments are config overrides, as for training.
Both write beside the output and rename it when complete; an existing output is refused
unless --overwrite.
"""

from __future__ import annotations

import argparse
import sys

from torchllm.checkpoint import EXPORT_DTYPES
from torchllm.hf.export import export_adapter, export_hf
from torchllm.hf.folder import parse_size
from torchllm.hf.load import import_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchllm.hf",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    overrides_note = "Other --section.key=value arguments override the run's config."
    p = sub.add_parser("export", help="DCP checkpoint -> Hugging Face model folder",
                       epilog=overrides_note)
    p.add_argument("--checkpoint", required=True, help="run folder, checkpoint folder or step-<N>")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default=None,
                   help="weights dtype (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="unpadded vocab (default: model.vocab_size, else the run's tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA run: a PEFT adapter folder, its base model in OUT/base "
                        "(default: the merged model)")
    p = sub.add_parser("import", help="Hugging Face model folder -> DCP seed checkpoint",
                       epilog="The target model comes from --job.config_file FILE and other "
                              "--section.key=value config overrides.")
    p.add_argument("--hf", required=True, help="folder with config.json and safetensors weights")
    p.add_argument("--out", required=True, help="new step-<N> folder to write")
    p.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="float32",
                   help="dtype of the saved weights")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.command == "export" and args.adapter:
            export_adapter(args.checkpoint, args.out, overrides, args.dtype,
                           parse_size(args.max_shard_size), args.vocab_size, args.overwrite)
        elif args.command == "export":
            export_hf(args.checkpoint, args.out, overrides, args.dtype,
                      parse_size(args.max_shard_size), args.vocab_size, args.overwrite)
        else:
            import_hf(args.hf, args.out, overrides, args.dtype, args.overwrite)
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
