"""The command line: any lm-evaluation-harness task on a torchllm checkpoint.

    python -m torchllm.eval.harness --checkpoint RUN --tasks arc_easy_local,hellaswag_local \
        [--limit N] [--num_fewshot K] [--batch_size B] [--output_path OUT] [--include_path DIR] \
        [--log_samples] [--tensorboard] [--data-dir DIR] [--section.key=value ...]
    torchrun --nproc_per_node 2 -m torchllm.eval.harness ...          (documents split over ranks)

lm-eval's own argument names where it has them. The shipped offline tasks
(torchllm/eval/harness_tasks/, tag `torchllm_local`) are always on the task path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path

INSTALL_HINT = ("error: lm-evaluation-harness is not installed; "
                "pip install -e \".[harness]\" (or pip install \"lm-eval>=0.4.5,<0.5\")")


def build_parser() -> argparse.ArgumentParser:
    from torchllm.eval.harness.data import LOCAL_TASKS, LOCAL_TAG
    from torchllm.eval.loading import CHECKPOINT_HELP, OVERRIDES_HELP

    parser = argparse.ArgumentParser(
        prog="python -m torchllm.eval.harness",
        description="lm-evaluation-harness tasks on a torchllm checkpoint.",
        epilog=OVERRIDES_HELP, allow_abbrev=False)
    add = parser.add_argument
    add("--checkpoint", required=True, help=CHECKPOINT_HELP)
    add("--tasks", required=True,
        help=f"comma-separated lm-eval tasks, groups or tags; offline: {', '.join(LOCAL_TASKS)} "
             f"(all four: {LOCAL_TAG})")
    add("--limit", type=float, help="documents per task (>= 1), or a fraction of each (< 1)")
    add("--num_fewshot", type=int, help="solved examples before each question (task default)")
    add("--batch_size", type=int, default=8, help="requests per forward pass (default 8)")
    add("--max_length", type=int, help="tokens per forward (default: the model's max_seq_len)")
    add("--max_gen_toks", type=int, default=256, help="generate_until's default new tokens")
    add("--output_path", help="write lm-eval's results JSON: this .json file, or a folder "
                              "(results_<timestamp>.json in it)")
    add("--log_samples", action="store_true",
        help="also write each document's requests and responses (samples_<task>.jsonl beside "
             "the results; needs --output_path)")
    add("--include_path", help="another folder of lm-eval task YAMLs")
    add("--seed", type=int, help="one seed for python, numpy, torch and the few-shot examples "
                                 "(default: lm-eval's, 0 for python and 1234 for the others)")
    add("--data-dir", help="folder of local task copies (default eval.tasks_data_dir, else "
                           "../shared/data/evals beside the checkout)")
    add("--tensorboard", action="store_true",
        help="also log the metrics to the run's TensorBoard at the checkpoint's step")
    add("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    return parser


def scalars(results: dict) -> dict[str, float]:
    """TensorBoard tags harness/<task>/<metric>[_<filter>] of the numeric metrics (no stderr)."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) or not filt:
                continue
            out[f"harness/{task}/{metric}" + ("" if filt == "none" else f"_{filt}")] = value
    return out


def write_results(results: dict, output_path: str) -> list[Path]:
    """lm-eval's results JSON (and samples_<task>.jsonl with --log_samples), each written to a
    temporary name first; returns the paths written."""
    from lm_eval.utils import handle_non_serializable

    samples = results.pop("samples", None)
    path = Path(output_path)
    if path.suffix != ".json":
        path = path / f"results_{datetime.now().isoformat().replace(':', '-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    files = {path: json.dumps(results, indent=2, default=handle_non_serializable,
                              ensure_ascii=False)}
    for task, rows in (samples or {}).items():
        files[path.with_name(f"samples_{task}.jsonl")] = "".join(
            json.dumps(r, default=handle_non_serializable, ensure_ascii=False) + "\n"
            for r in rows)
    for target, text in files.items():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
    return list(files)


def main(argv: list[str] | None = None) -> int:
    from torchllm.log import init_logger, logger

    from torchllm.config import ConfigError
    from torchllm.eval.loading import parse_args_and_overrides

    init_logger()
    try:
        args, overrides = parse_args_and_overrides(build_parser(), argv)
    except ConfigError as err:
        logger.error("error: %s", err)
        return 2
    try:
        import lm_eval  # noqa: F401  (optional: the [harness] extra)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    import contextlib
    import logging

    import datasets
    import torch
    import torch.distributed as dist
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from torchllm.checkpoint import open_checkpoint
    from torchllm.eval.harness.data import (LOCAL_TAG, LOCAL_TASKS, TASKS_DIR,
                                            check_local_tasks, resolve_sources)
    from torchllm.eval.harness.model import TorchllmLM
    from torchllm.eval.loading import inference_device, init_distributed, load_for_inference
    from torchllm.eval.reduce import rank_and_world
    from torchllm.hub import offline_note, prepare_hub
    from torchllm.precision import resolve_bf16

    datasets.disable_progress_bars()  # the copies are read from disk in a second
    # lm-eval suggests --metadata for every custom_dataset task: the CLI passes it already.
    logging.getLogger("lm_eval.api.task").addFilter(
        lambda record: "Custom kwargs can be passed" not in record.getMessage())
    try:
        if args.log_samples and not args.output_path:
            raise ValueError("--log_samples writes beside the results: give --output_path too")
        device = inference_device(args.device)
        init_distributed(device)
        reader = open_checkpoint(args.checkpoint)  # the step, read once and checked
        model, cfg, tokenizer = load_for_inference(reader, device, overrides)
        step_dir, step = reader.path, reader.step
        bf16, _ = resolve_bf16(cfg.training.mixed_precision, device.type, reader.precision)
        autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16
                    else contextlib.nullcontext)
        seeds = (dict(random_seed=args.seed, numpy_random_seed=args.seed,
                      torch_random_seed=args.seed, fewshot_random_seed=args.seed)
                 if args.seed is not None else {})  # else simple_evaluate's defaults
        lm = TorchllmLM(model, tokenizer, device, args.batch_size, args.max_length,
                        args.max_gen_toks, autocast, seed=1234 if args.seed is None else args.seed)
        sources = resolve_sources(args.data_dir, cfg.eval.tasks_data_dir,
                                  cfg.eval.hellaswag_data)
        include = [str(TASKS_DIR)] + ([args.include_path] if args.include_path else [])
        names = [t.strip() for t in args.tasks.split(",") if t.strip()]
        # lm-eval's own task index (thousands of YAMLs: ~7 s on 2 cores) is read only when a
        # task is not one of the included folders'.
        task_manager = TaskManager(include_path=include, include_defaults=False,
                                   metadata=sources)
        if any(t not in task_manager.all_tasks for t in names):
            task_manager = TaskManager(include_path=include, metadata=sources)
        unknown = [t for t in names if t not in task_manager.all_tasks]
        if unknown:
            raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; the offline ones "
                             f"are in {TASKS_DIR} (python -m lm_eval ls tasks lists lm-eval's)")
        check_local_tasks(names, **sources)  # a missing local copy fails now, in one line
    except (FileNotFoundError, ValueError) as err:  # ConfigError is a ValueError
        logger.error("error: %s", err)
        return 2
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    # lm-eval's own tasks read the Hub: offline, fail at once rather than retry for ~25 s.
    offline = prepare_hub() if set(names) - set(LOCAL_TASKS) - {LOCAL_TAG} else False
    try:
        results = simple_evaluate(
            model=lm, tasks=names, num_fewshot=args.num_fewshot, limit=limit,
            task_manager=task_manager, log_samples=args.log_samples, **seeds)
    except (ConnectionError, OSError) as err:
        if not offline:
            raise
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        logger.error("error: a task's data could not be loaded (%s)%s; the shipped tasks %s "
                     "run offline over local copies (python -m torchllm.eval.fetch)", first,
                     offline_note(offline), ", ".join(LOCAL_TASKS))
        return 2
    precision = "bf16" if bf16 else "fp32"
    if rank_and_world()[0] == 0:
        results["config"].update(model="torchllm", model_args={
            "checkpoint": str(step_dir), "step": step, "precision": precision,
            "max_length": lm.max_length})
        print(f"torchllm ({step_dir}, step {step}, {precision}), limit: {limit}, num_fewshot: "
              f"{args.num_fewshot}, batch_size: {args.batch_size}")
        print(make_table(results))
        if results.get("groups"):
            print(make_table(results, "groups"))
        if args.tensorboard:
            from torchllm.metrics.writers import TensorBoardWriter

            run_dir = step_dir.parent.parent  # dump_folder/<run>: its TensorBoard is beside it
            writer = TensorBoardWriter(run_dir.parent / cfg.metrics.tb_folder / run_dir.name)
            writer.write(step, scalars(results))
            writer.close()
            print(f"logged {len(scalars(results))} scalars to {writer.folder} at step {step}")
        if args.output_path:
            for path in write_results(results, args.output_path):
                print(f"wrote {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
