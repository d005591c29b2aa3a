"""Validation loss, perplexity and bits per byte of a checkpoint on any data source, without
training (nanoGPT's eval_only, nanochat's base_loss).

    python -m torchllm.eval.loss --checkpoint outputs/debug_model                 # run's val set
    python -m torchllm.eval.loss --checkpoint outputs/debug_model --data local:notes.txt

The windows are the ones in-training validation reads (`validation_loader`): without --data,
the set the run validated on (its validation.dataset up to its validation.max_tokens budget,
or its validation.split, else the held-out part of its training data), so the number and the
tokens equal the run's val/loss and the run header's validation tokens, whatever its number of
ranks; with the run's own data.dataset, its held-out part (the first validation.steps x global
batch windows, --steps; the global batch the checkpoint recorded); any other spec (local:,
shards:, embedded, hf:...) is read whole, up to --max-tokens (validation.max_tokens, 0 = the
auto budget). Batches
of training.local_batch_size windows of training.seq_len tokens, in the run's precision.

Bits per byte: the summed loss in bits over the UTF-8 bytes the scored target tokens decode to
(each window's targets decoded together), a measure that does not depend on the tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import sys
from pathlib import Path

import torch

from torchllm.checkpoint import Step, open_checkpoint
from torchllm.config import JobConfig
from torchllm.data import Batching, build_data, dedicated_validation, holds_out
from torchllm.eval.in_training import validation_loader
from torchllm.eval.loading import CHECKPOINT_HELP, inference_device, load_for_inference
from torchllm.eval.validation import validate
from torchllm.log import init_logger, logger
from torchllm.loss import IGNORE_INDEX
from torchllm.precision import resolve_bf16
from torchllm.run.process_exit import exit_process


def target_bytes(batches, steps: int, tokenizer) -> int:
    """UTF-8 bytes of the scored targets of the first `steps` batches (see the module doc)."""
    total = 0
    for _, batch in zip(range(steps), batches):
        for row in batch["targets"]:
            ids = row[row != IGNORE_INDEX].tolist()
            total += len(tokenizer.decode(ids).encode("utf-8"))
    return total


def recorded_global_batch(reader: Step) -> int | None:
    """The global batch (sequences) the checkpoint step was trained with, as its marker records
    it; None when it records none (the config's training.global_batch_size is used)."""
    saved = reader.marker.get("global_batch_size")
    return saved if isinstance(saved, int) and saved > 0 else None


def evaluation_batches(dcfg, vcfg, tcfg, batching: Batching, tokenizer, data: str | None,
                       steps: int | None, max_tokens: int | None,
                       global_batch: int | None = None):
    """(batches, how many, description): in-training validation's windows for `data`, of the
    run's [data], [validation] and [training] sections and `batching` (its Batching);
    `global_batch`: the run's (default: training.global_batch_size for one rank)."""
    vcfg = copy.deepcopy(vcfg)
    held_nothing = not holds_out(dcfg, vcfg)  # validation off: the run trained on every window
    vcfg.enable = True
    if data is not None:  # --data: that set, not the one the run validated on
        vcfg.split = ""
        vcfg.dataset = "" if data == dcfg.dataset else data
    # else: the run's own validation set (validation.dataset / split, or the held-out split)
    own = not dedicated_validation(dcfg, vcfg) and not vcfg.split
    if steps is not None:
        vcfg.steps = steps
    if max_tokens is not None:
        vcfg.max_tokens = max_tokens
    held_out = build_data(dcfg, vcfg, batching, tokenizer, 0, 1)[1] if own else None
    batches, n = validation_loader(dcfg, vcfg, tcfg, batching, tokenizer, held_out, 0, 1,
                                   global_batch)
    what = batches.describe().removeprefix("validation ") + f" ({n} batches)"
    if own and held_nothing and not vcfg.split:
        what += (" -- trained on: the run held nothing out of data.dataset (validation off, "
                 "or a validation.dataset of its own), so this loss is not a held-out one; "
                 "pass --data=DATASET the run did not read")
        logger.warning("%s", what)
    return batches, n, what


def evaluate_loss(model, cfg: JobConfig, tokenizer, device, data: str | None = None,
                  steps: int | None = None, max_tokens: int | None = None,
                  recorded: str | None = None, global_batch: int | None = None) -> dict:
    """{loss, perplexity, bits_per_byte, tokens, bytes, data} of `model` on `data`, in the
    precision the checkpoint recorded (`recorded`: "bf16"/"fp32"), else training's;
    `global_batch`: the run's, which sizes the held-out set (see evaluation_batches).

    An entry point (the body of `python -m torchllm.eval.loss`): it reads the checkpoint's
    whole config, the data's sections and the model's precision alike."""
    batching = Batching.of(cfg.training, cfg.job, cfg.model)
    batches, n, what = evaluation_batches(cfg.data, cfg.validation, cfg.training, batching,
                                          tokenizer, data, steps, max_tokens, global_batch)
    bf16, _ = resolve_bf16(cfg.training.mixed_precision, device.type, recorded)

    def autocast():
        return (torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())

    m = validate(model, batches, n, device, autocast=autocast)
    n_bytes = target_bytes(batches, n, tokenizer)
    bits = m["val/loss"] * m["val/tokens"] / math.log(2)
    return {"loss": m["val/loss"], "perplexity": m["val/perplexity"],
            "bits_per_byte": bits / max(n_bytes, 1), "tokens": int(m["val/tokens"]),
            "bytes": n_bytes, "data": what, "precision": "bf16" if bf16 else "fp32"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchllm.eval.loss",
        description="Validation loss, perplexity and bits per byte of a checkpoint on a data "
                    "source (the windows in-training validation uses).")
    add = parser.add_argument
    add("--checkpoint", required=True, help=CHECKPOINT_HELP)
    add("--data", help="data spec as in data.dataset: local:PATH, shards:DIR, embedded, hf:NAME "
                       "(default: the set the run validated on: validation.dataset, else its "
                       "held-out split)")
    add("--steps", type=int, help="batches of the held-out split (default validation.steps)")
    add("--max-tokens", type=int, help="tokens read from --data (default validation.max_tokens)")
    add("--json", help="write the numbers to this file")
    add("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    init_logger()
    try:
        device = inference_device(args.device)
        reader = open_checkpoint(args.checkpoint)  # the step, read once and checked
        model, cfg, tokenizer = load_for_inference(reader, device)
        result = evaluate_loss(model, cfg, tokenizer, device, args.data, args.steps,
                               args.max_tokens, reader.precision, recorded_global_batch(reader))
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        logger.error("error: %s", e)
        return 2
    print(f"checkpoint {args.checkpoint} | data {result['data']} | {result['precision']}")
    print(f"loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | bits per byte "
          f"{result['bits_per_byte']:.4f} | {result['tokens']:,} tokens, {result['bytes']:,} "
          "bytes")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**result, "checkpoint": str(args.checkpoint)},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    exit_process(main())
